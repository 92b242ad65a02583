"""Each worker's share of every global batch, planned from its measured speed.

This module owns the arithmetic of balanced per-worker batches (issue 35):
which contiguous slice of each global batch every worker computes, and when
that plan changes as the workers' speeds change. It does not measure time,
move examples or exchange anything: the step measures each worker's compute
seconds and all-reduces them, and the train step cuts each global batch by
the plan's slices (`tfdp.training.balanced_batches`). Because every worker feeds this module the same
all-reduced timings, every worker computes the same plan with no collective
of its own.

The model: worker w computes a share of s_w examples in about s_w * c_w
seconds, c_w its measured compute seconds per example (the wait in the
gradient all-reduce excluded). A synchronous step ends when the slowest
worker does, at max_w(s_w * c_w): the makespan. `plan_shares` gives the
integer shares, summing to the global batch, that minimise it. Global loss
normalisation makes the loss and gradient of unequal shares those of one
device on the whole global batch, so a plan changes speed, never results.

    planner = SharePlanner(global_batch=64, num_workers=2, replan_every=20)
    planner.observe([0.010, 0.020], shares=planner.plan.shares)  # seconds, one step
    new_plan = planner.maybe_replan(step=20)  # SharePlan((43, 21)) or None
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
from typing import Sequence

from tfdp import _checks


@dataclasses.dataclass(frozen=True)
class SharePlan:
    """How one global batch is split: worker w takes `shares[w]` examples.

    The shares partition the global batch in worker order: worker w's slice
    starts where worker w - 1's ends, so every example of the batch is
    computed exactly once, in the batch's own order.

    Attributes:
        shares: examples per worker, each >= 1.
    """

    shares: tuple[int, ...]

    def __post_init__(self):
        shares = tuple(self.shares)
        if not shares or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1
                             for s in shares):
            raise ValueError(f"`shares` must be a non-empty sequence of positive integers, one "
                             f"per worker. Received: shares={self.shares!r}")
        object.__setattr__(self, "shares", tuple(int(s) for s in shares))

    @property
    def global_batch(self) -> int:
        """Examples per step over all workers."""
        return sum(self.shares)

    @property
    def num_workers(self) -> int:
        return len(self.shares)

    def slice_of(self, worker: int) -> tuple[int, int]:
        """`(start, stop)` of `worker`'s examples within each global batch."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"`worker` must be in [0, {self.num_workers}). "
                             f"Received: worker={worker!r}")
        start = sum(self.shares[:worker])
        return start, start + self.shares[worker]

    def step_seconds(self, seconds_per_example: Sequence[float]) -> float:
        """The predicted synchronous step: the slowest worker's share times its cost."""
        return max(s * c for s, c in zip(self.shares, seconds_per_example))


def equal_plan(global_batch: int, num_workers: int) -> SharePlan:
    """The equal split, the first `global_batch % num_workers` workers one example more."""
    _check_sizes(global_batch, num_workers, minimum_share=1)
    base, extra = divmod(global_batch, num_workers)
    return SharePlan(tuple(base + (w < extra) for w in range(num_workers)))


def plan_shares(global_batch: int, seconds_per_example: Sequence[float], *,
                minimum_share: int = 1) -> SharePlan:
    """The integer shares that finish a global batch soonest.

    Each example goes, one at a time, to the worker that would finish it
    first (a heap on s_w * c_w + c_w); for per-example costs that is optimal:
    no other integer split has a smaller makespan. Ties go to the lower
    worker index, so equal costs give `equal_plan`.

    Args:
        global_batch: examples per step over all workers.
        seconds_per_example: each worker's measured compute seconds per
            example (positive, finite), in worker order.
        minimum_share: examples every worker keeps, however slow: a worker
            with no examples would still join every collective, and its
            speed could no longer be measured. Defaults to 1.

    Returns:
        A `SharePlan` summing to `global_batch`.

    Raises:
        ValueError: a cost that is not positive and finite, or a global batch
            too small for `minimum_share` on every worker.
    """
    costs = [float(c) for c in seconds_per_example]
    if not costs or not all(math.isfinite(c) and c > 0 for c in costs):
        raise ValueError(f"`seconds_per_example` must hold one positive, finite time per "
                         f"worker. Received: seconds_per_example={list(seconds_per_example)!r}")
    _check_sizes(global_batch, len(costs), minimum_share)
    shares = [minimum_share] * len(costs)
    heap = [((minimum_share + 1) * c, w) for w, c in enumerate(costs)]
    heapq.heapify(heap)
    for _ in range(global_batch - minimum_share * len(costs)):
        _, w = heapq.heappop(heap)
        shares[w] += 1
        heapq.heappush(heap, ((shares[w] + 1) * costs[w], w))
    return SharePlan(tuple(shares))


def _check_sizes(global_batch, num_workers, minimum_share) -> None:
    for name, value in (("global_batch", global_batch), ("num_workers", num_workers),
                        ("minimum_share", minimum_share)):
        _checks.check_int(name, value)
    if global_batch < minimum_share * num_workers:
        raise ValueError(
            f"A global batch of {global_batch} cannot give each of {num_workers} workers "
            f"{minimum_share} example(s). Raise the global batch to at least "
            f"{minimum_share * num_workers}, or lower `minimum_share`.")


class SharePlanner:
    """Keeps each worker's speed from its step timings and re-plans the shares.

    Every worker holds one planner and feeds it the same all-reduced timings,
    so all of them hold the same plan at the same step.

    Args:
        global_batch: examples per step over all workers; every plan sums to it.
        num_workers: workers sharing each global batch.
        replan_every: steps between two plannings (`maybe_replan` plans only
            when `step` is a multiple). Defaults to 20.
        smoothing: weight of the newest step in each worker's exponential
            moving average of seconds per example, in (0, 1]. Defaults to 0.3.
        min_gain: a new plan is adopted only when it predicts a step at least
            this fraction shorter than the current plan's, so timing noise
            does not move examples back and forth. Defaults to 0.05.
        minimum_share: see `plan_shares`. Defaults to 1.
    """

    def __init__(self, *, global_batch: int, num_workers: int, replan_every: int = 20,
                 smoothing: float = 0.3, min_gain: float = 0.05, minimum_share: int = 1):
        _check_sizes(global_batch, num_workers, minimum_share)
        _checks.check_int("replan_every", replan_every)
        if not 0 < smoothing <= 1:
            raise ValueError(f"`smoothing` must be in (0, 1]. Received: smoothing={smoothing!r}")
        if not 0 <= min_gain < 1:
            raise ValueError(f"`min_gain` must be in [0, 1). Received: min_gain={min_gain!r}")
        self.plan = equal_plan(global_batch, num_workers)
        self.replan_every = replan_every
        self.smoothing = smoothing
        self.min_gain = min_gain
        self.minimum_share = minimum_share
        self.seconds_per_example: list[float] | None = None

    def observe(self, step_seconds: Sequence[float], shares: Sequence[int]) -> None:
        """Adds one step's compute seconds per worker, measured at `shares`.

        Args:
            step_seconds: each worker's compute seconds for the step (the
                collective's wait excluded), in worker order. A step with a
                non-positive or non-finite time is ignored (a worker that
                timed nothing, or a clock that jumped).
            shares: the examples each worker computed in that step.
        """
        if len(step_seconds) != self.plan.num_workers or len(shares) != self.plan.num_workers:
            raise ValueError(
                f"`step_seconds` and `shares` must hold one value per worker "
                f"({self.plan.num_workers}). Received: step_seconds={list(step_seconds)!r}, "
                f"shares={list(shares)!r}")
        seconds = [float(t) for t in step_seconds]
        if not all(math.isfinite(t) and t > 0 for t in seconds) or min(shares) < 1:
            return
        newest = [t / s for t, s in zip(seconds, shares)]
        if self.seconds_per_example is None:
            self.seconds_per_example = newest
        else:
            a = self.smoothing
            self.seconds_per_example = [a * n + (1 - a) * old
                                        for n, old in zip(newest, self.seconds_per_example)]

    def maybe_replan(self, step: int) -> SharePlan | None:
        """Every `replan_every` steps, the plan for the speeds seen so far, if it is worth it.

        Returns:
            The new plan (now also `self.plan`), or None: not a planning step,
            no timings yet, or a predicted gain below `min_gain`.
        """
        if step % self.replan_every:
            return None
        return self.replan()

    def replan(self) -> SharePlan | None:
        """The plan for the speeds seen so far, now, if it is worth it (`maybe_replan` without the cadence).

        Returns:
            The new plan (now also `self.plan`), or None: no timings yet, or
            a predicted gain below `min_gain`.
        """
        if self.seconds_per_example is None:
            return None
        candidate = plan_shares(self.plan.global_batch, self.seconds_per_example,
                                minimum_share=self.minimum_share)
        current = self.plan.step_seconds(self.seconds_per_example)
        if candidate == self.plan or candidate.step_seconds(
                self.seconds_per_example) > (1 - self.min_gain) * current:
            return None
        self.plan = candidate
        return candidate
