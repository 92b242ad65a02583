"""Where a `tfdp-train` run's wall time goes: a clock of named phases.

This module owns the bookkeeping only: `PhaseClock` charges wall time to
named phases, each second to exactly one phase (a phase begun inside another
pauses the outer one, so the phases never overlap and their sum never
exceeds the wall time), counts events (pipeline builds, step calls) and
keeps one row per epoch (its time, its step time, the rest). What a phase
means is decided by its callers: `tfdp.app.train` (the process's start,
imports and checks) and `tfdp.app.experiment` (strategy, pipeline builds,
steps, the final evaluation, outputs), which document each in
`PHASES`. It imports neither TensorFlow nor Keras, so it can be tested, and
`process_start` called, without them.

    clock = PhaseClock(origin=process_start())
    clock.record("imports", clock.elapsed())
    with clock.phase("strategy"):
        ...
    print(clock.describe())  # imports 6.9 s, strategy 1.2 s; 8.1 s since the process started
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

#: Every phase `tfdp-train` reports, in run order, with what it covers.
PHASES = {
    "imports": "from the process's start (the kernel's start time in /proc/self/stat) "
               "to main() with every module imported and the flags parsed: the "
               "interpreter, TensorFlow, Keras and tfdp's patches",
    "checks": "the flags, model and dataset checked before the strategy exists",
    "strategy": "the strategy built and the workers' rendezvous, the configuration "
                "compared across workers",
    "pipeline_builds": "every call that builds an input pipeline (train and eval), "
                       "including the ones during training",
    "model": "the model and optimizer built",
    "first_step": "the first training call: tracing and the first steps",
    "steps": "every later training call (steps_per_loop steps each)",
    "outside_steps": "the training loop's time outside its calls and the pipeline "
                     "builds: new iterators, checkpoint saves, callbacks, metric reads",
    "final_eval": "the evaluation after training (its pipeline build is in pipeline_builds)",
    "outputs": "the final checkpoint, the eval TensorBoard scalars and curves.png (not "
               "summary.json, which holds the phases)",
}


def process_start(clock: Callable[[], float] = time.perf_counter) -> float | None:
    """When this process started, on `clock`'s scale (`time.perf_counter` by default).

    Reads the kernel's start time of the process (`/proc/self/stat`, field
    22, in clock ticks since boot: 10 ms resolution) and its age against
    `CLOCK_BOOTTIME`, so the interpreter's own start-up and every import
    before this call are covered.

    Returns:
        The start time, or None where `/proc` or `CLOCK_BOOTTIME` is missing
        (not Linux).
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22; fields[0] is field 3 (state)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return clock() - max(age, 0.0)


class PhaseClock:
    """Wall time by phase, counts and epoch rows of one run.

    Args:
        origin: the time the run's wall time starts from, on `clock`'s scale
            (e.g. `process_start()`). Defaults to now.
        clock: seconds, monotonic. Defaults to `time.perf_counter`.
    """

    def __init__(self, *, origin: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.origin = clock() if origin is None else origin
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._open: list[list] = []  # [name, running since]
        self._epochs: list[dict] = []
        self._epoch_open: list = []  # [epoch, started, steps s, first call s] while one runs
        self._step_started: float | None = None
        self._steps_seen = 0

    # --- phases ---------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since `origin`."""
        return self._clock() - self.origin

    def record(self, name: str, seconds: float) -> None:
        """Adds `seconds` to phase `name` (a span measured elsewhere)."""
        if seconds < 0:
            raise ValueError(f"`seconds` must be >= 0. Received: {name}={seconds!r}")
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def begin(self, name: str) -> None:
        """Starts charging phase `name`; the phase running until now pauses."""
        now = self._clock()
        if self._open:
            running, since = self._open[-1]
            self.record(running, now - since)
        self._seconds.setdefault(name, 0.0)
        self._open.append([name, now])

    def end(self, name: str) -> None:
        """Stops phase `name`, the innermost one running; the one it paused resumes.

        Raises:
            ValueError: `name` is not the innermost phase running.
        """
        if not self._open or self._open[-1][0] != name:
            raise ValueError(
                f"Phases end innermost first: {name!r} is not the innermost running phase. "
                f"Running: {[entry[0] for entry in self._open]}")
        now = self._clock()
        _, since = self._open.pop()
        self.record(name, now - since)
        if self._open:
            self._open[-1][1] = now

    @contextlib.contextmanager
    def phase(self, name: str):
        """`begin(name)` on entry, `end(name)` on exit (also on an exception)."""
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def count(self, name: str, n: int = 1) -> None:
        """Adds `n` to the count `name` (e.g. `"train_pipeline_builds"`)."""
        self._counts[name] = self._counts.get(name, 0) + n

    # --- steps and epochs -------------------------------------------------------

    def step_begin(self) -> None:
        """A training call starts: the run's first goes to `first_step`, later ones to `steps`."""
        self._step_started = self._clock()
        self.begin("first_step" if self._steps_seen == 0 else "steps")

    def step_end(self) -> None:
        """The training call `step_begin` started has returned."""
        if self._step_started is None:
            raise ValueError("step_end() without a step_begin().")
        self.end("first_step" if self._steps_seen == 0 else "steps")
        if self._epoch_open:
            seconds = self._clock() - self._step_started
            self._epoch_open[2] += seconds
            if self._epoch_open[3] is None:
                self._epoch_open[3] = seconds
        self._step_started = None
        self._steps_seen += 1
        self.count("step_calls")

    def epoch_begin(self, epoch: int) -> None:
        """Epoch `epoch` starts (the one running, if any, ends here)."""
        if self._epoch_open:
            self.epoch_end()
        self._epoch_open = [epoch, self._clock(), 0.0, None]

    @property
    def current_epoch(self) -> int | None:
        """The epoch `epoch_begin` started and no `epoch_end` has ended, or None."""
        return self._epoch_open[0] if self._epoch_open else None

    def epoch_end(self) -> None:
        """The running epoch ends: one row, `{"epoch", "seconds", "steps_seconds",
        "outside_seconds", "first_call_seconds"}`; outside is the epoch's time minus
        its training calls (pipeline rebuilds, the new iterator, saves,
        callbacks); its first call (None: none ran) is in `steps_seconds`, and
        shows a slow start of the epoch. No epoch running: nothing."""
        if not self._epoch_open:
            return
        epoch, started, steps, first_call = self._epoch_open
        seconds = self._clock() - started
        self._epochs.append({"epoch": epoch, "seconds": seconds, "steps_seconds": steps,
                             "outside_seconds": max(seconds - steps, 0.0),
                             "first_call_seconds": first_call})
        self._epoch_open = []

    # --- results --------------------------------------------------------------

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds by phase: `PHASES`' order, then others in the order they first
        began (a running phase up to now)."""
        seconds = dict(self._seconds)
        if self._open:
            name, since = self._open[-1]
            seconds[name] += self._clock() - since
        order = {name: i for i, name in enumerate(PHASES)}
        return dict(sorted(seconds.items(), key=lambda item: order.get(item[0], len(order))))

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def epochs(self) -> list[dict]:
        return [dict(row) for row in self._epochs]

    def summary(self) -> dict:
        """`{"seconds": {phase: s}, "counts": {name: n}, "epochs": [rows],
        "wall_seconds", "unaccounted_seconds"}`; wall from `origin` to now,
        unaccounted = wall − the phases' sum (≥ 0 but for rounding)."""
        seconds = self.seconds
        wall = self.elapsed()
        return {
            "seconds": seconds,
            "counts": self.counts,
            "epochs": self.epochs,
            "wall_seconds": wall,
            "unaccounted_seconds": wall - sum(seconds.values()),
        }

    def describe(self, summary: dict | None = None) -> str:
        """One line: each phase's seconds in order, then the counts and the wall time.

        E.g. `imports 6.9 s, strategy 1.2 s, pipeline_builds 1.1 s (train 5, eval 1),
        first_step 1.9 s, steps 5.0 s (219 calls), outside_steps 18.0 s (10 epochs);
        wall 35.3 s (0.2 s not in a phase)`.

        Args:
            summary: a `summary()` to describe. Defaults to a new one.
        """
        summary = summary if summary is not None else self.summary()
        counts = summary["counts"]
        notes = {}
        builds = [f"{role} {counts[f'{role}_pipeline_builds']}" for role in ("train", "eval")
                  if f"{role}_pipeline_builds" in counts]
        if builds:
            notes["pipeline_builds"] = f" ({', '.join(builds)})"
        if "step_calls" in counts and counts["step_calls"] > 1:
            notes["steps"] = f" ({counts['step_calls'] - 1} calls)"
        if summary["epochs"]:
            notes["outside_steps"] = f" ({len(summary['epochs'])} epochs)"
        parts = [f"{name} {value:.1f} s{notes.get(name, '')}"
                 for name, value in summary["seconds"].items()]
        return (f"{', '.join(parts)}; wall {summary['wall_seconds']:.1f} s "
                f"({summary['unaccounted_seconds']:.1f} s not in a phase)")
