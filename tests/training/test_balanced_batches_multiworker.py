"""Balanced batches on two real MultiWorkerMirroredStrategy workers, one held to a quarter of a CPU.

One launch (`balanced_batches_job.py`), worker 1 inside a CPU cgroup at 0.25
CPU (`tfdp.bench.straggler`): each worker reads every global batch whole
and computes its share in the step.

- a fixed unequal plan equals one device on the same global batches, on
  both workers, and each worker computed its own share;
- re-planned from the measured seconds, the plan moves examples to the
  unthrottled worker 0, and both workers adopt the same plans at the same
  steps (no collective of their own decides them).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from multiworker import python_command, run_launch

from tfdp.bench import straggler

JOB_SCRIPT = Path(__file__).with_name("balanced_batches_job.py")
_spec = importlib.util.spec_from_file_location("balanced_batches_job", JOB_SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(straggler.why_unavailable() is not None,
                       reason=str(straggler.why_unavailable())),
]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("balanced_mw")
    command = [sys.executable, "-m", "tfdp.bench.straggler", "--rank", "1", "--cpu_fraction",
               "0.25", "--", *python_command(JOB_SCRIPT, str(out))]
    result = run_launch(command, nproc=2, timeout=300, cwd=out)
    assert result.returncode == 0, result.describe()
    print(f"2-worker balanced batches job: {result.elapsed:.1f} s")
    print("\n".join(result.worker_stdout(0) + result.worker_stdout(1)))
    loaded = []
    for rank in range(2):
        with np.load(out / f"rank{rank}.npz") as data:
            loaded.append(dict(data))
    return loaded


def test_fixed_unequal_plan_equals_one_device_on_two_workers(records):
    reference = job.build_model()
    reference.compile(optimizer=job.optimizer(), loss=job.loss())
    reference.fit(job.dataset(), epochs=1, verbose=0)
    timed = job.STEPS - 1  # the first step's timings are dropped as warm-up
    for record in records:
        for i, w in enumerate(reference.get_weights()):
            np.testing.assert_allclose(record[f"fixed_weight{i}"], w, atol=1e-5, rtol=0)
        assert tuple(record["fixed_plan"]) == job.FIXED_PLAN
        np.testing.assert_array_equal(record["fixed_totals"][2:],
                                      [job.FIXED_PLAN[0] * timed, job.FIXED_PLAN[1] * timed,
                                       timed])


def test_plan_moves_toward_the_unthrottled_worker(records):
    history = records[0]["moving_history"]
    assert len(history), "the plan never moved"
    # Every worker adopted the same plans after the same steps.
    np.testing.assert_array_equal(records[1]["moving_history"], history)
    final = records[0]["moving_plan"]
    assert final.sum() == job.WIDE_BATCH
    assert final[0] > final[1], history
    seconds = records[0]["moving_seconds_per_example"]
    assert seconds[1] > seconds[0], (history, seconds)
