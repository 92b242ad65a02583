"""`python -m tfdp.bench.resume` at the smallest size: both sources, one line each.

Plumbing only (a process of its own, as a user runs it); its timings are
never asserted.
"""

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_resume_benchmark_times_both_sources_at_the_planned_step(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "tfdp.bench.resume", "--num_examples=64", "--global_batch=16",
         "--repeats=1", "--noepoch", f"--data_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    assert "64 examples, global batch 16 on 2 CPU replicas: 4 steps per epoch, resume at step 3 " \
           "(75%)" in lines, lines
    timed = [line for line in lines if re.match(
        r"^(synthetic JPEG \(indexed\)|TFRecord PNG files): resume at step 3: previous \(iterator "
        r"advanced 3 times\) \d+\.\d\d s, seek \d+\.\d\d s", line)]
    assert [line.split(":")[0] for line in timed] == ["synthetic JPEG (indexed)",
                                                      "TFRecord PNG files"], lines
