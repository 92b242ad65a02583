"""A random-fault soak: many kills at seeded random moments, and the run still ends exactly.

Two workers train through `tfdp-launch --max_restarts 20`
(`fault_tolerance_job.py`, 3 epochs of 6 steps, a checkpoint every 2 steps)
while a seeded schedule stops a random worker on each of the first attempts,
a random number of steps after the step it resumed from: SIGKILLs, two kills
of the chief in the middle of a checkpoint write, and one SIGTERM (a
preemption: every worker saves and exits 42). For `fit` and for `Trainer`:
the run completes, every scheduled kill happened, the final step count is the
planned one, each example of each epoch is in the surviving state exactly
once, and the final weights equal an uninterrupted run's. Each attempt
resumes exactly where it must: after a SIGKILL before step s, from the last
checkpoint before it; after a kill inside the write of checkpoint s, from
the one before (the half-written one is not used). These cover what
`test_fault_tolerance.py`'s single-kill cases checked.
"""

from __future__ import annotations

import random
import re

import pytest

import fault_tolerance_job as job
from multiworker import python_command, run_launch
from test_fault_tolerance import (_assert_each_example_once_per_epoch,
                                  _assert_finished_like_an_uninterrupted_run, _records,
                                  _start_step, _surviving_ids)

KILLS = 8
MAX_RESTARTS = 20
TIMEOUT = 600.0


def kill_schedule(seed: int, kills: int = KILLS) -> list[str]:
    """One stop per attempt `0 .. kills - 1`, in `fault_tolerance_job`'s syntax.

    Every stop comes 1 to 4 steps after the attempt's resume step (so it
    happens before the 18 planned steps are done); a kill during a
    checkpoint write comes at the next or the one after (2 or 4 steps). The
    first attempt's kill comes after its first checkpoint (step 3 or 4): a
    run restarted before it has any starts from its initialisation again, which
    here is seeded differently on purpose (`fault_tolerance_job._seed`).
    """
    rng = random.Random(seed)
    term, *saves = rng.sample(range(1, kills), 3)
    schedule = []
    for attempt in range(kills):
        if attempt == term:
            schedule.append(f"{attempt}:+{rng.randint(1, 4)}:term@{rng.randint(0, 1)}")
        elif attempt in saves:
            schedule.append(f"{attempt}:+{rng.choice((2, 4))}:save")
        else:
            low = 3 if attempt == 0 else 1
            schedule.append(f"{attempt}:+{rng.randint(low, 4)}@{rng.randint(0, 1)}")
    return schedule


def expected_resume(stop: str, start: int) -> int | None:
    """Where the attempt after `stop` (one schedule entry) resumes, from `start`; None: a save."""
    _, step, *where = stop.split("@")[0].split(":")
    offset = int(step)
    if where == ["term"]:
        return None  # saved after the step that was running, wherever the loop ends
    if where == ["save"]:
        return start + offset - job.SAVE_EVERY  # the checkpoint before the half-written one
    # Killed before step start + offset: the last checkpoint of the steps done.
    done = start + offset - 1
    return done - done % job.SAVE_EVERY


def test_kill_schedule_is_seeded_and_mixes_every_kind():
    schedule = kill_schedule(7)
    assert schedule == kill_schedule(7) != kill_schedule(8)
    assert len(schedule) == KILLS
    assert sum(":term" in s for s in schedule) == 1
    assert sum(":save" in s for s in schedule) == 2


@pytest.mark.slow
@pytest.mark.parametrize("loop, seed", [("fit", 1), ("custom", 2)])
def test_random_kills_leave_the_run_as_if_never_stopped(tmp_path, loop, seed):
    schedule = kill_schedule(seed)
    result = run_launch(
        python_command(job.__file__, loop, str(tmp_path), ",".join(schedule)), nproc=2,
        timeout=TIMEOUT, cwd=tmp_path,
        launch_args=["--grace_period", "2", "--max_restarts", str(MAX_RESTARTS)])
    assert result.returncode == 0, result.describe()
    restarts = [m for m in result.launcher_messages() if "restarting the group" in m]
    attempts = len(restarts) + 1
    # Every scheduled stop happened: one restart each, and none more.
    assert attempts == KILLS + 1, (schedule, restarts)
    starts = [_start_step(tmp_path, a) for a in range(attempts)]
    assert starts == sorted(starts), starts  # nothing committed was ever lost
    for attempt, stop in enumerate(schedule):
        want = expected_resume(stop, starts[attempt])
        assert want is None or starts[attempt + 1] == want, (stop, starts)
    _assert_finished_like_an_uninterrupted_run(tmp_path, nproc=2)
    _assert_each_example_once_per_epoch(_surviving_ids(tmp_path, attempts=attempts))
    # Steps trained by an attempt after the checkpoint the next one resumed from.
    redone = 0
    for attempt in range(attempts - 1):
        steps = {r["step"] for r in _records(tmp_path) if r["attempt"] == attempt}
        redone += len([s for s in steps if s > starts[attempt + 1]])
    exits = sorted(set(re.findall(r"exit(?:ed)? (?:with )?(?:code )?(-?\d+)", " ".join(restarts))))
    print(f"soak {loop}: {KILLS} stops survived ({schedule}), resume steps {starts}, "
          f"{redone} step(s) trained again, {result.elapsed:.0f} s in all, exits {exits}")
