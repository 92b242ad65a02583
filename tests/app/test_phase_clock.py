"""`tfdp.app.phase_clock`: each second charged to one phase, on a fake clock (no TensorFlow)."""

import pytest

from tfdp.app import phase_clock
from tfdp.app.phase_clock import PhaseClock


class FakeClock:
    """A clock that moves only when told."""

    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def fake():
    return FakeClock()


def test_nested_phases_pause_the_outer_one(fake):
    clock = PhaseClock(origin=90.0, clock=fake)
    clock.record("imports", clock.elapsed())  # 10 s since the origin
    clock.begin("outside_steps")
    fake.advance(1.0)
    with clock.phase("pipeline_builds"):
        fake.advance(2.0)
    fake.advance(0.5)
    clock.end("outside_steps")
    fake.advance(0.25)  # in no phase
    summary = clock.summary()
    assert summary["seconds"] == {"imports": 10.0, "pipeline_builds": 2.0, "outside_steps": 1.5}
    assert summary["wall_seconds"] == 13.75
    assert summary["unaccounted_seconds"] == pytest.approx(0.25)


def test_steps_and_epochs_split_the_training_time(fake):
    clock = PhaseClock(clock=fake)
    clock.begin("outside_steps")
    for epoch in range(2):
        clock.epoch_begin(epoch)
        with clock.phase("pipeline_builds"):
            clock.count("train_pipeline_builds")
            fake.advance(0.5)
        for seconds in (3.0 if epoch == 0 else 1.0, 1.0):
            clock.step_begin()
            fake.advance(seconds)
            clock.step_end()
            fake.advance(0.125)  # metric reads between calls
        clock.epoch_end()
        fake.advance(0.25)  # between epochs
    clock.end("outside_steps")
    summary = clock.summary()
    assert summary["seconds"] == {"pipeline_builds": 1.0, "first_step": 3.0, "steps": 3.0,
                                  "outside_steps": 4 * 0.125 + 2 * 0.25}
    assert summary["counts"] == {"train_pipeline_builds": 2, "step_calls": 4}
    assert summary["epochs"] == [
        {"epoch": 0, "seconds": 4.75, "steps_seconds": 4.0, "outside_seconds": 0.75,
         "first_call_seconds": 3.0},
        {"epoch": 1, "seconds": 2.75, "steps_seconds": 2.0, "outside_seconds": 0.75,
         "first_call_seconds": 1.0},
    ]
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_seconds"])
    line = clock.describe(summary)
    assert line.startswith("pipeline_builds 1.0 s (train 2), first_step 3.0 s, "
                           "steps 3.0 s (3 calls), outside_steps 1.0 s (2 epochs); wall 8.0 s")


def test_a_new_epoch_ends_the_running_one(fake):
    clock = PhaseClock(clock=fake)
    clock.epoch_begin(0)
    fake.advance(2.0)
    clock.epoch_begin(1)  # the Trainer's epochs end when the next one's dataset is asked for
    fake.advance(1.0)
    clock.epoch_end()
    clock.epoch_end()  # none running: nothing
    assert [(row["epoch"], row["seconds"], row["first_call_seconds"])
            for row in clock.epochs] == [(0, 2.0, None), (1, 1.0, None)]


def test_phases_are_reported_in_run_order(fake):
    clock = PhaseClock(clock=fake)
    for name in ("outputs", "custom", "strategy", "imports"):
        with clock.phase(name):
            fake.advance(1.0)
    assert list(clock.seconds) == ["imports", "strategy", "outputs", "custom"]


def test_a_running_phase_counts_up_to_now(fake):
    clock = PhaseClock(clock=fake)
    clock.begin("strategy")
    fake.advance(2.0)
    assert clock.seconds == {"strategy": 2.0}


def test_phases_must_end_innermost_first(fake):
    clock = PhaseClock(clock=fake)
    clock.begin("outside_steps")
    clock.begin("pipeline_builds")
    with pytest.raises(ValueError, match="'outside_steps' is not the innermost"):
        clock.end("outside_steps")
    with pytest.raises(ValueError, match="step_end"):
        clock.step_end()
    with pytest.raises(ValueError, match="must be >= 0"):
        clock.record("imports", -1.0)


def test_process_start_is_before_now():
    start = phase_clock.process_start()
    if start is None:
        pytest.skip("no /proc/self/stat or CLOCK_BOOTTIME here")
    import time

    age = time.perf_counter() - start
    # This process has run at least as long as pytest took to get here, and
    # not longer than the machine's uptime.
    assert 0.0 < age < time.clock_gettime(time.CLOCK_BOOTTIME)


def test_every_phase_says_what_it_covers():
    assert all(phase_clock.PHASES.values())
    assert list(phase_clock.PHASES)[:3] == ["imports", "checks", "strategy"]
