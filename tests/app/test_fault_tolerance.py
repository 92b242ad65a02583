"""Killed workers, restarted groups and changed worker counts, end to end.

Each test runs `tests/fault_tolerance_job.py` on real worker processes through
`tfdp-launch` (with `--max_restarts`), kills the last worker with SIGKILL
at a chosen optimizer step, and checks what a user relies on: the run
completes, its step counter ends at the planned total, its weights equal an
uninterrupted run's, and, counting example ids, every example of every epoch
was trained on exactly once by the state that survived. Restarts after kills
(of any worker, inside checkpoint writes, several in a row) are the random
soak's (`test_fault_soak.py`, which checks each resume step); this file keeps
the resumes on another number of workers and the helpers the soak shares.
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
