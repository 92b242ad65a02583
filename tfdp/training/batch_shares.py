"""Each worker's share of every global batch, planned from its measured speed.

This module owns the arithmetic of balanced per-worker batches (issue 35):
which contiguous slice of each global batch every worker computes, and when
that plan changes as the workers' speeds change. It does not measure time,
move examples or exchange anything: the step measures each worker's busy
seconds (its whole step but the gradient all-reduce) and all-reduces them,
and the train step cuts each global batch by
the plan's slices (`tfdp.training.balanced_batches`). Because every worker feeds this module the same
all-reduced timings, every worker computes the same plan with no collective
of its own.

The model is affine: worker w computes a share of s_w examples in about
a_w + b_w * s_w seconds, a_w a fixed cost per step (op dispatch, kernel
launches: large for a small model) and b_w a cost per example, both measured
as busy seconds (the gradient all-reduce excluded). A
synchronous step ends when the slowest worker does, at
max_w(a_w + b_w * s_w): the makespan. `plan_shares` gives the integer shares,
summing to the global batch, that minimise it. Global loss normalisation
makes the loss and gradient of unequal shares those of one device on the
whole global batch, so a plan changes speed, never results.

A plan is worth adopting only when its gain is a real part of the whole
synchronous step (`required_gain`): the shares shorten the busy part only,
and where the exchange or the host take most of a step, a gain of 5% of the
busy part is not worth the examples moved.

A per-example-only model (a_w = 0) is wrong whenever the fixed cost is not
small: the worker with the smaller share then looks slower per example, gets
fewer examples still, and the plan drifts away from the equal split on equal
workers. `SharePlanner` therefore estimates both terms (`AffineCost`).

    planner = SharePlanner(global_batch=64, num_workers=2, replan_every=20)
    planner.observe([0.20, 0.40], [640, 640], steps=20,  # one window's sums
                    whole_step_seconds=0.45)  # the synchronous step's, all-reduce included
    new_plan = planner.maybe_replan(step=20)  # SharePlan((43, 21)) or None
"""

from __future__ import annotations

import collections
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

    def step_seconds(self, seconds_per_example: Sequence[float],
                     fixed_seconds: Sequence[float] | None = None) -> float:
        """The predicted synchronous step: max_w(fixed_seconds[w] + shares[w] * seconds_per_example[w]).

        Args:
            seconds_per_example: b_w, seconds per example, one per worker.
            fixed_seconds: a_w, seconds per step whatever the share, one per
                worker. Defaults to zeros.
        """
        fixed = fixed_seconds if fixed_seconds is not None else [0.0] * self.num_workers
        return max(a + s * c for s, c, a in zip(self.shares, seconds_per_example, fixed))


@dataclasses.dataclass(frozen=True)
class AffineCost:
    """Each worker's step seconds as a function of its share: a_w + b_w * s_w.

    Attributes:
        fixed_seconds: a_w, seconds per step whatever the share (>= 0), one
            per worker.
        seconds_per_example: b_w, seconds per example of the share (> 0),
            one per worker.
        relative_noise: the root mean square of the fit's residuals,
            relative to the slowest worker's mean step seconds (0.05: the
            windows scatter about 5% of a step around the model). Defaults
            to 0.
    """

    fixed_seconds: tuple[float, ...]
    seconds_per_example: tuple[float, ...]
    relative_noise: float = 0.0

    def step_seconds(self, plan: SharePlan) -> float:
        """The makespan of `plan` under this model, in seconds."""
        return plan.step_seconds(self.seconds_per_example, self.fixed_seconds)


#: Windows a planner times before its first plan (`SharePlanner.required_gain`).
MIN_WINDOWS = 3


def equal_plan(global_batch: int, num_workers: int) -> SharePlan:
    """The equal split, the first `global_batch % num_workers` workers one example more."""
    _check_sizes(global_batch, num_workers, minimum_share=1)
    base, extra = divmod(global_batch, num_workers)
    return SharePlan(tuple(base + (w < extra) for w in range(num_workers)))


def plan_shares(global_batch: int, seconds_per_example: Sequence[float], *,
                fixed_seconds: Sequence[float] | None = None,
                minimum_share: int = 1) -> SharePlan:
    """The integer shares that finish a global batch soonest.

    Each example goes, one at a time, to the worker that would finish it
    first (a heap on a_w + b_w * (s_w + 1)). Each worker's step time is
    non-decreasing in its share, so this is optimal: the greedy order is the
    order of a rising deadline, and at every deadline it has given each
    worker as many examples as it can finish by then, so no other integer
    split has a smaller makespan. Ties go to the lower worker index, so
    equal costs give `equal_plan`.

    Args:
        global_batch: examples per step over all workers.
        seconds_per_example: b_w, each worker's compute seconds per example
            (positive, finite), in worker order.
        fixed_seconds: a_w, each worker's compute seconds per step whatever
            its share (non-negative, finite), in worker order. Defaults to
            zeros (a per-example model).
        minimum_share: examples every worker keeps, however slow: a worker
            with no examples would still join every collective, and its
            speed could no longer be measured. Defaults to 1.

    Returns:
        A `SharePlan` summing to `global_batch`.

    Raises:
        ValueError: a cost that is not positive and finite, a fixed cost
            that is negative or not finite, lengths that differ, or a global
            batch too small for `minimum_share` on every worker.
    """
    costs = [float(c) for c in seconds_per_example]
    if not costs or not all(math.isfinite(c) and c > 0 for c in costs):
        raise ValueError(f"`seconds_per_example` must hold one positive, finite time per "
                         f"worker. Received: seconds_per_example={list(seconds_per_example)!r}")
    fixed = [0.0] * len(costs) if fixed_seconds is None else [float(a) for a in fixed_seconds]
    if len(fixed) != len(costs) or not all(math.isfinite(a) and a >= 0 for a in fixed):
        raise ValueError(f"`fixed_seconds` must hold one non-negative, finite time per worker "
                         f"({len(costs)}). Received: fixed_seconds={fixed_seconds!r}")
    _check_sizes(global_batch, len(costs), minimum_share)
    shares = [minimum_share] * len(costs)
    heap = [(a + (minimum_share + 1) * c, w) for w, (c, a) in enumerate(zip(costs, fixed))]
    heapq.heapify(heap)
    for _ in range(global_batch - minimum_share * len(costs)):
        _, w = heapq.heappop(heap)
        shares[w] += 1
        heapq.heappush(heap, (fixed[w] + (shares[w] + 1) * costs[w], w))
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


def fit_affine_costs(shares: Sequence[Sequence[float]], seconds: Sequence[Sequence[float]],
                     weights: Sequence[float], *, max_fixed_examples: float,
                     fixed_examples: float | None = None) -> tuple[AffineCost, float | None]:
    """Least-squares fit of each worker's step seconds to b_w * (f + s_w).

    The fixed cost, counted in examples (f = a_w / b_w), is shared by all
    workers: they run the same program, and a slower worker (a throttled
    CPU, a busy host) is slower at both the fixed and the per-example work.
    A worker's own a_w and b_w would need its share to vary to be told apart
    from one another; sharing f needs only one worker whose share varied,
    and makes equal workers' plan equal whatever f is, so noise in f cannot
    move their examples.

    Args:
        shares: `[points][workers]`, each point's mean examples per step.
        seconds: `[points][workers]`, each point's mean compute seconds per
            step (positive).
        weights: `[points]`, each point's weight (>= 0), e.g. by recency.
        max_fixed_examples: the largest f searched (> 0).
        fixed_examples: f to use when no worker's share varied over the
            points (every f then fits them exactly), or None: 0, a
            per-example model.

    Returns:
        `(cost, f)`: the fitted `AffineCost` (with the residuals'
        `relative_noise`), and f if the points determined
        it (some worker's share varied by at least one example), else None.
    """
    num_workers = len(shares[0])
    used = [i for i, w in enumerate(weights) if w > 0]
    varied = any(max(shares[i][w] for i in used) - min(shares[i][w] for i in used) >= 1
                 for w in range(num_workers))

    total = sum(weights[i] for i in used)
    # Residuals are relative to the slowest worker's mean step: the step's
    # length, which the plan is for (a fast worker's few-microsecond jitter is
    # no uncertainty about it).
    scale = max(sum(weights[i] * seconds[i][w] for i in used) / total
                for w in range(num_workers))

    def slopes(f):
        """Each worker's b_w for f, and the weighted relative squared residual."""
        b, residual = [], 0.0
        for w in range(num_workers):
            num = sum(weights[i] * seconds[i][w] * (f + shares[i][w]) for i in used)
            den = sum(weights[i] * (f + shares[i][w]) ** 2 for i in used)
            b.append(num / den)
            residual += sum(weights[i] * (seconds[i][w] - b[-1] * (f + shares[i][w])) ** 2
                            for i in used) / scale ** 2
        return b, residual

    if varied:
        # A log-spaced grid from 1/100 example to the cap, and 0: f is a planning
        # input, so a grid ~4% apart is as good as the exact minimum.
        grid = [0.0] + [max_fixed_examples * 10 ** (-k / 60) for k in range(0, 60 * int(
            math.ceil(math.log10(max_fixed_examples * 100))) + 1)]
        found = min(grid, key=lambda f: slopes(f)[1])
    else:
        found = None
    f = found if found is not None else (fixed_examples or 0.0)
    b, residual = slopes(f)
    noise = math.sqrt(residual / (num_workers * total))
    return AffineCost(tuple(f * bw for bw in b), tuple(b), noise), found


class SharePlanner:
    """Keeps each worker's affine speed from its timings and re-plans the shares.

    Every worker holds one planner and feeds it the same all-reduced timings,
    so all of them hold the same plan at the same step.

    Each `observe` is one point per worker: its mean examples and mean
    busy seconds per step over a window. The cost model is fitted to the
    last `history` points (`fit_affine_costs`), the newest weighted 1 and
    each older one `1 - smoothing` times the next. The fixed cost can only be
    told from the per-example cost once some worker's share has changed; till
    then the model is per-example (which moves a slow worker's examples in
    the right direction, less far than needed), and the fixed cost is kept
    once found, so a plan that then stays put does not lose it.

    Args:
        global_batch: examples per step over all workers; every plan sums to it.
        num_workers: workers sharing each global batch.
        replan_every: steps between two plannings (`maybe_replan` plans only
            when `step` is a multiple). Defaults to 20.
        smoothing: weight of the newest point against the one before it, in
            (0, 1]: each older point weighs `1 - smoothing` times the next.
            Defaults to 0.3.
        min_gain: a new plan is adopted only when it predicts a step at least
            this fraction shorter than the current plan's, plus a margin for
            the timings' noise (`required_gain`), so timing noise does not
            move examples back and forth. Defaults to 0.05.
        minimum_share: see `plan_shares`. Defaults to 1.
        history: points kept for the fit. Defaults to 12.
        confidence: the noise margin in standard errors: the predicted gain
            must exceed `min_gain` by `confidence` times the standard error
            of a ratio of two workers' fitted costs. Defaults to 2.

    Attributes:
        plan: the current `SharePlan`.
        cost: the fitted `AffineCost`, or None before any timing.
        fixed_examples: the fixed cost in examples (a_w / b_w) last found,
            or None while no share has varied.
        points: the windows kept, `(mean shares, mean busy seconds)` per
            step, one value per worker each.
        whole_steps: each kept window's whole step seconds, or None.
    """

    def __init__(self, *, global_batch: int, num_workers: int, replan_every: int = 20,
                 smoothing: float = 0.3, min_gain: float = 0.05, minimum_share: int = 1,
                 history: int = 12, confidence: float = 2.0):
        _check_sizes(global_batch, num_workers, minimum_share)
        _checks.check_int("replan_every", replan_every)
        _checks.check_int("history", history)
        if not 0 < smoothing <= 1:
            raise ValueError(f"`smoothing` must be in (0, 1]. Received: smoothing={smoothing!r}")
        if not 0 <= min_gain < 1:
            raise ValueError(f"`min_gain` must be in [0, 1). Received: min_gain={min_gain!r}")
        _checks.check_float("confidence", confidence, minimum=0)
        self.plan = equal_plan(global_batch, num_workers)
        self.confidence = float(confidence)
        self.replan_every = replan_every
        self.smoothing = smoothing
        self.min_gain = min_gain
        self.minimum_share = minimum_share
        self.points: collections.deque = collections.deque(maxlen=history)
        self.whole_steps: collections.deque = collections.deque(maxlen=history)
        self.cost: AffineCost | None = None
        self.fixed_examples: float | None = None
        self._weights: list[float] = []

    @property
    def seconds_per_example(self) -> list[float] | None:
        """b_w of the fitted model, one per worker, or None before any timing."""
        return None if self.cost is None else list(self.cost.seconds_per_example)

    @property
    def fixed_seconds(self) -> list[float] | None:
        """a_w of the fitted model, one per worker, or None before any timing."""
        return None if self.cost is None else list(self.cost.fixed_seconds)

    def observe(self, step_seconds: Sequence[float], shares: Sequence[float], *,
                steps: int = 1, whole_step_seconds: float | None = None) -> None:
        """Adds one window's busy seconds and examples per worker, and refits the model.

        Args:
            step_seconds: each worker's busy seconds summed over the
                window's `steps` steps (the collective's wait excluded), in
                worker order. A window with a non-positive or non-finite
                time is ignored (a worker that timed nothing, or a clock
                that jumped).
            shares: the examples each worker computed, summed over the window.
            steps: the steps of the window. Defaults to 1.
            whole_step_seconds: the synchronous step's seconds summed over
                the window, the exchange included, or None: unknown. A
                plan's gain is then weighed against the whole step, not
                only the part the shares control (`required_gain`).
                Defaults to None.
        """
        if len(step_seconds) != self.plan.num_workers or len(shares) != self.plan.num_workers:
            raise ValueError(
                f"`step_seconds` and `shares` must hold one value per worker "
                f"({self.plan.num_workers}). Received: step_seconds={list(step_seconds)!r}, "
                f"shares={list(shares)!r}")
        _checks.check_int("steps", steps)
        seconds = [float(t) for t in step_seconds]
        if not all(math.isfinite(t) and t > 0 for t in seconds) or min(shares) < steps:
            return
        whole = None
        if whole_step_seconds is not None and math.isfinite(whole_step_seconds) and (
                whole_step_seconds > 0):
            whole = float(whole_step_seconds) / steps
        self.points.append(([float(s) / steps for s in shares], [t / steps for t in seconds]))
        self.whole_steps.append(whole)
        n = len(self.points)
        self._weights = weights = [(1 - self.smoothing) ** (n - 1 - i) for i in range(n)]
        self.cost, found = fit_affine_costs(
            [p[0] for p in self.points], [p[1] for p in self.points], weights,
            max_fixed_examples=8.0 * self.plan.global_batch, fixed_examples=self.fixed_examples)
        if found is not None:
            self.fixed_examples = found

    @property
    def whole_step_seconds(self) -> float | None:
        """The whole synchronous step's seconds, weighted over the windows as the fit, or None."""
        known = [(w, t) for w, t in zip(self._weights, self.whole_steps) if t is not None]
        total = sum(w for w, _ in known)
        return sum(w * t for w, t in known) / total if known and total > 0 else None

    def required_gain(self) -> float | None:
        """The predicted gain a new plan needs now, relative to the current plan's modelled step.

        `min_gain` of the whole synchronous step (`whole_step_seconds`, when
        the windows gave it and it is longer than the modelled step) plus a
        margin for the timings' noise. The shares shorten only the part of
        the step the model times; a gain of 5% of that part is much less of
        the step when the exchange or the host take most of it, and not
        worth the examples moved (equal workers keep the equal split).

        The fit's relative noise sigma, over n_eff = (sum of weights)^2 /
        (sum of squared weights) windows, gives each worker's fitted cost a
        relative standard error of about sigma / sqrt(n_eff - 1) (one
        degree of freedom spent on the fit), and a ratio of two workers'
        costs sqrt(2) times that. None with fewer than `MIN_WINDOWS`
        windows: one window says nothing of the noise, and two give each
        worker's scatter one degree of freedom, too few to trust (a planner
        that planned after two windows moved on noise in the `stragglers`
        bench case, 2026-11-28).
        """
        if self.cost is None or len(self.points) < MIN_WINDOWS:
            return None
        total = sum(self._weights)
        n_eff = total ** 2 / sum(w * w for w in self._weights)
        if n_eff <= 1:
            return None
        error = self.cost.relative_noise * math.sqrt(2.0 / (n_eff - 1))
        modelled = self.cost.step_seconds(self.plan)
        whole = self.whole_step_seconds
        scale = max(whole, modelled) / modelled if whole is not None and modelled > 0 else 1.0
        return self.min_gain * scale + self.confidence * error

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
            The new plan (now also `self.plan`), or None: fewer than
            `MIN_WINDOWS` windows timed, or a predicted makespan less than
            `required_gain()` shorter than the current plan's under the same
            model.
        """
        needed = self.required_gain()
        if needed is None:
            return None
        candidate = plan_shares(self.plan.global_batch, self.cost.seconds_per_example,
                                fixed_seconds=self.cost.fixed_seconds,
                                minimum_share=self.minimum_share)
        current = self.cost.step_seconds(self.plan)
        if candidate == self.plan or self.cost.step_seconds(candidate) > (1 - needed) * current:
            return None
        self.plan = candidate
        return candidate
