"""`tfdp.bench.straggler`: a real CPU cgroup holds one process (or one launched worker) back.

Never asserts a speed: the quota's effect is read from the kernel's own
count of throttled periods, and each group must be gone afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tfdp.bench import straggler

pytestmark = pytest.mark.skipif(straggler.why_unavailable() is not None,
                                reason=str(straggler.why_unavailable()))

#: Burns one CPU for 0.6 s of wall time, then prints its cgroups.
_BUSY = ("import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\n"
         "print(open('/proc/self/cgroup').read())")


def _leftover_groups() -> list[str]:
    root, _ = straggler._hierarchy()
    return [name for name in os.listdir(root) if name.startswith("tfdp-straggler-")]


def test_a_busy_process_in_the_group_is_throttled_and_the_group_is_removed():
    before = _leftover_groups()
    with straggler.cpu_limited(0.2) as group:
        assert os.path.isdir(group.path)
        child = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE, text=True)
        group.add(child.pid)
        assert child.pid in group.pids()
        out, _ = child.communicate(timeout=60)
        # 0.6 s of spinning at 0.2 CPU: several 100 ms periods hit the quota.
        assert group.throttled_periods() >= 2
        assert os.path.basename(group.path) in out
    assert not os.path.exists(group.path)
    assert _leftover_groups() == before


def test_processes_still_in_the_group_are_moved_out_before_it_is_removed():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with straggler.cpu_limited(0.5) as group:
            group.add(child.pid)
        assert not os.path.exists(group.path)
        with open(f"/proc/{child.pid}/cgroup") as f:
            assert "tfdp-straggler-" not in f.read()
    finally:
        child.kill()
        child.wait()


def test_the_group_is_removed_when_the_block_raises():
    with pytest.raises(KeyError):
        with straggler.cpu_limited(0.5) as group:
            raise KeyError("boom")
    assert not os.path.exists(group.path)


@pytest.mark.parametrize("rank, slowed", [("1", True), ("0", False)])
def test_the_wrapper_slows_only_the_worker_of_its_rank(rank, slowed):
    env = dict(os.environ, TFDP_RANK=rank)
    before = _leftover_groups()
    done = subprocess.run(
        [sys.executable, "-m", "tfdp.bench.straggler", "--rank", "1", "--cpu_fraction", "0.5",
         "--", sys.executable, "-c", _BUSY],
        env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("tfdp-straggler-" in done.stdout) is slowed, done.stdout
    assert _leftover_groups() == before


def test_the_wrapper_exits_with_the_commands_status():
    done = subprocess.run(
        [sys.executable, "-m", "tfdp.bench.straggler", "--", sys.executable, "-c",
         "import sys; sys.exit(7)"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr


@pytest.mark.parametrize("fraction", [0, -1, 0.001, 65, True, "half"])
def test_a_fraction_out_of_range_is_refused_naming_it(fraction):
    with pytest.raises(ValueError, match="cpu_fraction"):
        with straggler.cpu_limited(fraction):
            pass


def test_the_command_line_refuses_a_missing_command_and_a_bad_fraction():
    for argv, message in (([], "give the command to run"),
                          (["--cpu_fraction", "0", "--", "true"], "cpu_fraction")):
        done = subprocess.run([sys.executable, "-m", "tfdp.bench.straggler", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert message in done.stderr, done.stderr


def test_an_empty_group_left_by_a_killed_wrapper_is_removed_by_the_next_one():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    root, _ = straggler._hierarchy()
    orphan = os.path.join(root, f"{straggler.PREFIX}{child.pid}-0")
    os.mkdir(orphan)
    try:
        with straggler.cpu_limited(0.5):
            assert not os.path.exists(orphan)
    finally:
        if os.path.exists(orphan):
            os.rmdir(orphan)


def test_the_wrapper_passes_sigterm_on_and_removes_its_group():
    before = _leftover_groups()
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "tfdp.bench.straggler", "--", sys.executable, "-c",
         "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert wrapper.stdout.readline().strip() == "ready"
    wrapper.terminate()
    assert wrapper.wait(timeout=30) == 42  # the command's own exit, after its handler
    assert _leftover_groups() == before


def test_a_process_in_the_group_finds_its_group_and_quota():
    """What a benchmark worker records as proof that it ran throttled (`current_group`)."""
    assert straggler.current_group() is None  # this test process runs in no group
    code = ("from tfdp.bench import straggler\ng = straggler.current_group()\n"
            "print(g.path, g.cpu_fraction, g.throttled_periods())")
    out = subprocess.run([sys.executable, "-m", "tfdp.bench.straggler", "--cpu_fraction", "0.3",
                          "--", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    path, fraction, throttled = out
    assert os.path.basename(path).startswith(straggler.PREFIX)
    assert float(fraction) == 0.3 and int(throttled) >= 0
    assert not os.path.exists(path)  # removed when the command ended
