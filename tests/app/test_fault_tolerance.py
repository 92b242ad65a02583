"""Killed workers, restarted groups and changed worker counts, end to end.

Each test runs `tests/fault_tolerance_job.py` on real worker processes through
`tfdp-launch` (with `--max_restarts`), kills the last worker with SIGKILL
at a chosen optimizer step, and checks what a user relies on: the run
completes, its step counter ends at the planned total, its weights equal an
uninterrupted run's, and, counting example ids, every example of every epoch
was trained on exactly once by the state that survived.
"""

import collections
import json
import signal

import numpy as np
import pytest

import fault_tolerance_job as job
from multiworker import python_command, run_launch

JOB = job.__file__
#: Seconds one launch (all its attempts) may take.
TIMEOUT = 300.0


def _launch(tmp_path, loop, kills="-", *, nproc=2, max_restarts=0):
    launch_args = ["--grace_period", "2", "--max_restarts", str(max_restarts)]
    return run_launch(python_command(JOB, loop, str(tmp_path), kills), nproc=nproc,
                      timeout=TIMEOUT, cwd=tmp_path, launch_args=launch_args)


def _records(tmp_path):
    records = []
    for path in sorted(tmp_path.glob("seen-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


def _start_step(tmp_path, attempt):
    """The step attempt `attempt` resumed from (the same on every worker)."""
    steps = {int(p.read_text()) for p in tmp_path.glob(f"start-{attempt}-*")}
    assert len(steps) == 1, steps
    return steps.pop()


def _surviving_ids(tmp_path, attempts):
    """Ids of the batches whose updates the final weights contain.

    Attempt a's batches count up to the step attempt a + 1 resumed from; the
    rest were lost with the killed group (and trained again).
    """
    ids = []
    for record in _records(tmp_path):
        attempt = record["attempt"]
        if attempt + 1 < attempts and record["step"] > _start_step(tmp_path, attempt + 1):
            continue
        ids += record["ids"]
    return ids


def _assert_each_example_once_per_epoch(ids):
    by_epoch = collections.defaultdict(collections.Counter)
    for i in ids:
        by_epoch[i // job.ID_STRIDE][i % job.ID_STRIDE] += 1
    assert sorted(by_epoch) == list(range(job.EPOCHS))
    for epoch, counts in by_epoch.items():
        twice = {i: n for i, n in counts.items() if n != 1}
        assert not twice, f"epoch {epoch}: examples trained on more than once: {twice}"
        assert sorted(counts) == list(range(job.NUM_EXAMPLES)), f"epoch {epoch}: some missing"


def _assert_finished_like_an_uninterrupted_run(tmp_path, nproc):
    for rank in range(nproc):
        with np.load(tmp_path / f"final-{rank}.npz") as final:
            final = dict(final)
        assert int(final["steps"]) == job.TOTAL_STEPS
        count = len([k for k in final if k.startswith("weight")])
        for i in range(count):
            np.testing.assert_allclose(final[f"weight{i}"], final[f"reference{i}"],
                                       atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_never_stopped(tmp_path, loop):
    result = _launch(tmp_path, loop, "0:8", max_restarts=1)
    assert result.returncode == 0, result.describe()
    messages = result.launcher_messages()
    assert any("restarting the group (attempt 2 of 2)" in m for m in messages), messages
    resumed_at = _start_step(tmp_path, 1)
    assert resumed_at == 6  # the last checkpoint before step 8: nothing newer was lost
    _assert_finished_like_an_uninterrupted_run(tmp_path, nproc=2)
    _assert_each_example_once_per_epoch(_surviving_ids(tmp_path, attempts=2))


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_a_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, loop):
    result = _launch(tmp_path, loop, "0:6:save", max_restarts=1)
    assert result.returncode == 0, result.describe()
    # The chief died with ckpt-6's files written but not yet recorded as the
    # latest: the restart used ckpt-4, and trained steps 5 and 6 again.
    assert _start_step(tmp_path, 1) == 4
    _assert_finished_like_an_uninterrupted_run(tmp_path, nproc=2)
    _assert_each_example_once_per_epoch(_surviving_ids(tmp_path, attempts=2))


@pytest.mark.slow
def test_three_failures_then_success_with_max_restarts_3(tmp_path):
    result = _launch(tmp_path, "custom", "0:5,1:9,2:14", max_restarts=3)
    assert result.returncode == 0, result.describe()
    assert [_start_step(tmp_path, a) for a in range(4)] == [0, 4, 8, 12]
    _assert_finished_like_an_uninterrupted_run(tmp_path, nproc=2)
    _assert_each_example_once_per_epoch(_surviving_ids(tmp_path, attempts=4))


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resuming_with_another_number_of_workers_keeps_the_global_batch(
    tmp_path, before, after
):
    stopped = _launch(tmp_path, "custom", "0:9", nproc=before)
    assert stopped.returncode == 128 + signal.SIGKILL, stopped.describe()
    # The rerun has other attempts' numbering: its restart count starts at 0
    # again, so move the first run's records out of the way first.
    first = _records(tmp_path)
    for path in tmp_path.glob("seen-*.jsonl"):
        path.unlink()
    (tmp_path / "start-0-0").rename(tmp_path / "first-start")
    for path in tmp_path.glob("start-0-*"):
        path.unlink()
    resumed = _launch(tmp_path, "custom", nproc=after)
    assert resumed.returncode == 0, resumed.describe()
    resumed_at = _start_step(tmp_path, 0)
    assert resumed_at == 8
    _assert_finished_like_an_uninterrupted_run(tmp_path, nproc=after)
    ids = [i for r in first if r["step"] <= resumed_at for i in r["ids"]]
    ids += [i for r in _records(tmp_path) for i in r["ids"]]
    _assert_each_example_once_per_epoch(ids)
