"""Balanced per-replica batches: each replica computes a share of every global batch that follows its speed.

This module owns what `tfdp.compile(..., balance_batches=True)` adds to a
synchronous step (issue 35, item 2):

- **the cut, inside the step.** Every replica is fed the whole global batch
  (`tfdp.training.replicated_input`) and computes its contiguous slice
  `[start_r, stop_r)` of it, from a plan variable (int32, one share per
  replica, equal on every replica) read inside the step. The cut is made in
  the step, not in the input pipeline, so that a new plan applies to the same
  global batch on every replica: elements already prefetched by a pipeline
  would otherwise still be cut by the old plan. The slices partition the
  batch, in order, whatever its size (`slice_bounds`: a last, smaller batch
  is cut in proportion to the plan), so every example is computed exactly
  once. Global loss normalisation makes the loss, gradient and logged loss
  those of one device on the global batch whatever the shares
  (`tfdp.training.loss_normalization`).
- **the clock.** Each replica measures with `tf.timestamp` its busy seconds
  for the step: from when its previous step's gradient all-reduce returned
  to when this step's gradients are ready (the previous update, the loop,
  the next batch from the input, the cut, the forward and backward pass; a
  counts all-reduce inside left out; an execution's first step from its
  slice), and how long its previous step's all-reduce took. A slower worker
  is slower at all of it, not only at the forward and backward pass, and a
  synchronous step waits for the last worker to reach the all-reduce. Its
  seconds and examples, at its own positions of a `[3 × replicas]` vector
  (zeros elsewhere), ride in the gradients' own all-reduce
  (`OptimizerStep.carrying`): no collective of their own. Every replica
  adds the sums to the same accumulators.
- **the re-planner** (`after_steps`, run between executions by `Replanner`,
  a Keras callback `fit` runs, and by `tfdp.Trainer`'s loops): every
  `replan_every` steps, at the end of an execution of the train function, it
  reads the accumulated seconds, examples and steps, feeds the window's mean
  share and mean seconds per step to a
  `tfdp.training.batch_shares.SharePlanner` (an affine model, seconds =
  a fixed cost per step + a cost per example x share, fitted to the recent
  windows, the newest weighted most; a new plan only when it predicts a step
  at least `min_gain` of the whole step, busy plus exchange, shorter) and
  assigns the plan variable: no retracing, no new dataset. Every worker reads
  the same all-reduced sums at the same step, so every worker computes the
  same plan with no collective. The first execution's timings (warm-up) are
  dropped.

It does not own the planning arithmetic (`batch_shares`), the input's
replication (`replicated_input`), nor which options may be combined with it
(`tfdp.training.option_rules`).
"""

from __future__ import annotations

import dataclasses
import threading

import keras
import tensorflow as tf
from absl import logging

from tfdp import _checks
from tfdp.training import batch_shares


@dataclasses.dataclass(frozen=True)
class BalanceOptions:
    """How balanced batches plan (`tfdp.compile(balance_batches=BalanceOptions(...))`).

    Attributes:
        replan_every: optimizer steps between two plannings, or `None` to
            keep `shares` for the whole run. Planning happens at the end of
            the execution (`steps_per_execution` steps) in which the count
            is reached. Defaults to 20.
        shares: the first plan, one positive share per replica (in replica
            order; their sum is the plan's resolution, usually the global
            batch), or `None`: equal shares. Defaults to `None`.
        smoothing: weight of the newest window against the one before it
            in the fit of each replica's step seconds (each older window
            weighs `1 - smoothing` times the next), in (0, 1]. Defaults to 0.3.
        min_gain: a new plan is adopted only when it predicts a step at
            least this fraction shorter, plus a margin for the timings'
            noise (`SharePlanner.required_gain`), in [0, 1). Defaults to 0.05.
    """

    replan_every: int | None = 20
    shares: tuple[int, ...] | None = None
    smoothing: float = 0.3
    min_gain: float = 0.05

    def __post_init__(self):
        _checks.check_int("replan_every", self.replan_every, allow_none=True)
        if self.shares is not None:
            object.__setattr__(self, "shares", batch_shares.SharePlan(tuple(self.shares)).shares)
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"`smoothing` must be in (0, 1]. Received: smoothing={self.smoothing!r}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"`min_gain` must be in [0, 1). Received: min_gain={self.min_gain!r}")


def options_of(balance_batches) -> BalanceOptions | None:
    """The `BalanceOptions` of `tfdp.compile`'s `balance_batches` argument (None: off).

    Raises:
        TypeError: it is neither a bool nor a `BalanceOptions`.
    """
    if balance_batches is False:
        return None
    if balance_batches is True:
        return BalanceOptions()
    if isinstance(balance_batches, BalanceOptions):
        return balance_batches
    raise TypeError(
        "`balance_batches` must be True, False or a "
        "tfdp.training.balanced_batches.BalanceOptions. "
        f"Received: balance_batches={_checks.echo(balance_batches)}")


def check_loss_normalization(loss_normalization: str) -> None:
    """Refuses `"per_replica"` loss normalisation, whose result would depend on the plan."""
    if loss_normalization != "global":
        raise ValueError(
            "balance_batches=True cannot be combined with loss_normalization="
            f"{loss_normalization!r}: each replica's own mean, averaged, weights the "
            "examples of a small share more than those of a large one, so the result "
            "would depend on the plan. Use loss_normalization='global' (the default) with "
            "balance_batches, or balance_batches=False.")


def slice_bounds(plan: tf.Tensor, examples: tf.Tensor) -> tf.Tensor:
    """int64 `[replicas + 1]`: where each replica's slice of a batch of `examples` starts and stops.

    Replica r computes rows `[bounds[r], bounds[r + 1])`. When `examples`
    equals the plan's sum these are the plan's shares exactly; otherwise (a
    last, smaller batch) each cumulative share is scaled to `examples` and
    rounded down. Either way the slices partition the batch, in order.

    Args:
        plan: int32 `[replicas]`, positive shares.
        examples: scalar, the batch's examples.
    """
    cumulative = tf.cumsum(tf.cast(plan, tf.int64))
    scaled = cumulative * tf.cast(examples, tf.int64) // cumulative[-1]
    return tf.concat([tf.zeros([1], tf.int64), scaled], 0)


class BalancedBatches:
    """The state of balanced batches on one strategy: the plan, the timings and the planner.

    Built by `tfdp.compile` in the strategy's scope.

    Args:
        strategy: the `tf.distribute.Strategy` of the model (2+ replicas).
        options: the `BalanceOptions`.

    Attributes:
        plan: int32 variable `[replicas]`, each replica's share, equal on
            every replica; assigned between executions only.
        totals: float32 variable `[2 × replicas + 1]`: since the last
            planning, each replica's busy seconds (`riders`), each
            replica's examples, and the steps timed; equal on every replica.
        exchange_totals: float32 variable `[replicas + 1]`: since the
            last planning, each replica's seconds in the all-reduce of the
            step before each timed step that had one in its execution, and
            those steps; equal on every replica.
        spans: float64 variable `[4]`, each replica its own: since the
            warm-up, its compute (slice to gradients), busy and exchange
            seconds summed, and the steps (diagnostics: what the shares
            scale and what they do not).
        planner: the `SharePlanner`, made at the first planning (when the
            global batch is known).
        history: `(step, shares)` of every plan adopted, the first one included.
    """

    def __init__(self, strategy: tf.distribute.Strategy, options: BalanceOptions):
        self.strategy = strategy
        self.num_replicas = strategy.num_replicas_in_sync
        self.options = options
        if options.shares is not None and len(options.shares) != self.num_replicas:
            raise ValueError(
                f"`BalanceOptions.shares` must hold one share per replica "
                f"({self.num_replicas}). Received: shares={options.shares!r}")
        with strategy.scope():
            # aggregation NONE: every replica computes the same value and
            # updates its own copy, with no collective (as Keras' loss scale).
            self.plan = tf.Variable(
                options.shares or [1] * self.num_replicas, dtype=tf.int32, trainable=False,
                aggregation=tf.VariableAggregation.NONE, name="balanced_batches_plan")
            self.totals = tf.Variable(
                tf.zeros([2 * self.num_replicas + 1]), trainable=False,
                aggregation=tf.VariableAggregation.NONE, name="balanced_batches_totals")
            # Each replica's own, never read across replicas: when its last
            # step's gradient all-reduce returned (float64 seconds since the
            # epoch; 0 at the start of an execution), and how long that
            # all-reduce took from its gradients being ready.
            self.mark = tf.Variable(
                tf.zeros([2], tf.float64), trainable=False,
                aggregation=tf.VariableAggregation.NONE, name="balanced_batches_mark")
            # Since the last planning, equal on every replica: each replica's
            # exchange seconds (its gradients ready to the all-reduce's
            # return, of the step before each timed one), and the steps that
            # had a step before them in their execution.
            self.exchange_totals = tf.Variable(
                tf.zeros([self.num_replicas + 1]), trainable=False,
                aggregation=tf.VariableAggregation.NONE, name="balanced_batches_exchange_totals")
            # Diagnostics, each replica its own, since the warm-up: seconds
            # summed of [compute (its slice ready to its gradients ready),
            # busy (what `riders` reports), exchange] and the steps.
            self.spans = tf.Variable(
                tf.zeros([4], tf.float64), trainable=False,
                aggregation=tf.VariableAggregation.NONE, name="balanced_batches_spans")
        # Trace-time hand-over from `riders` to `add_sums`, per replica
        # thread (MirroredStrategy traces its replicas in threads).
        self._tracing = threading.local()
        self.planner: batch_shares.SharePlanner | None = None
        self.history: list[tuple[int, tuple[int, ...]]] = []
        self.steps = 0  # steps run, counted on the host
        self.begin()

    # --- inside the step (replica context) --------------------------------------

    def replica_slice(self, data):
        """This replica's slice of the global batch `data` (a nest of tensors, batch first)."""
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group
        if tf.is_tensor(replica) and tf.get_static_value(replica) is not None:
            replica = int(tf.get_static_value(replica))  # a constant: index statically
        first = next(t for t in tf.nest.flatten(data) if t is not None)
        bounds = slice_bounds(self.plan, tf.shape(first, out_type=tf.int64)[0])
        start, stop = bounds[replica], bounds[replica + 1]
        return tf.nest.map_structure(lambda t: None if t is None else t[start:stop], data)

    def start_clock(self, data):
        """`(data, clock)`: `data` made to wait for a timestamp taken once it is ready."""
        with tf.control_dependencies(_tensors(data)):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            data = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), data)
        return data, Clock(start)

    def riders(self, clock: "Clock", gradients, examples: tf.Tensor) -> tf.Tensor:
        """float32 `[3 × replicas]`: this replica's busy seconds, examples and last exchange seconds.

        Each at this replica's own position (zeros elsewhere), so the
        all-reduce's sum holds every replica's.

        Busy seconds: from when this replica's previous step's gradient
        all-reduce returned (`mark`) to when this step's gradients are
        ready, the collectives inside the span left out. That is all the
        step asks of the replica but the gradient all-reduce: the previous
        step's optimizer update, the loop, the next batch from the input
        pipeline, the cut, the forward and backward pass. A slower worker
        is slower at all of it, and a synchronous step waits for the last
        worker to reach the all-reduce. The first step of an execution (no
        `mark`: the host ran in between) is timed from its slice.

        Exchange seconds: how long the previous step's all-reduce took on
        this replica (0 on an execution's first step). The planner weighs a
        predicted gain against the whole step, busy plus exchange.
        """
        end = clock.end([g for g in gradients if g is not None])
        mark = self.mark.read_value()
        chained = mark[0] > 0
        start = tf.where(chained, mark[0], clock.start)
        seconds = clock.seconds(start, end)
        context = tf.distribute.get_replica_context()
        position = tf.one_hot(tf.cast(context.replica_id_in_sync_group, tf.int32),
                              self.num_replicas, dtype=tf.float32)
        self._tracing.pending = (clock.seconds(clock.start, end), seconds, end, chained)
        return tf.concat([position * seconds, position * tf.cast(examples, tf.float32),
                          position * tf.cast(mark[1], tf.float32)], 0)

    def add_sums(self, sums: tf.Tensor) -> None:
        """Adds one step's summed riders (and the step) to the totals, on this replica's copy.

        Called with the all-reduce's result: the time it returned is this
        replica's `mark`, where its next step's busy span starts.
        """
        r = self.num_replicas
        compute, busy, end, chained = self._tracing.pending
        self._tracing.pending = None
        self.totals.assign_add(tf.concat([sums[:2 * r], tf.ones([1])], 0))
        self.exchange_totals.assign_add(
            tf.concat([sums[2 * r:], tf.cast(tf.reshape(chained, [1]), tf.float32)], 0))
        with tf.control_dependencies([sums]):
            returned = tf.timestamp()
        self.spans.assign_add(tf.stack([tf.cast(compute, tf.float64), tf.cast(busy, tf.float64),
                                        returned - end, tf.ones([], tf.float64)]))
        self.mark.assign(tf.stack([returned, returned - end]))

    # --- between executions (host) -------------------------------------------

    def begin(self) -> None:
        """At the start of a training run: the next execution's timings are warm-up."""
        self._warm = False
        self._since = 0
        self.mark.assign(tf.zeros_like(self.mark))

    def after_steps(self, steps: int, *, log: bool = False) -> batch_shares.SharePlan | None:
        """After an execution of `steps` steps: re-plans once `replan_every` steps have run.

        The first execution after `begin` only drops its timings (tracing and
        warm-up are not a speed). Every worker calls it after the same steps,
        so every worker re-plans at the same step.

        Returns:
            The new plan, or None.
        """
        self.steps += steps
        # The host's time between executions is no replica's step.
        self.mark.assign(tf.zeros_like(self.mark))
        if not self._warm:
            self._warm = True
            self.reset_timings()
            self.spans.assign(tf.zeros_like(self.spans))
            return None
        every = self.options.replan_every
        if every is None:
            return None
        self._since += steps
        if self._since < every:
            return None
        self._since = 0
        before = tuple(int(s) for s in self.plan.numpy())
        new = self.replan()
        if new is not None and log:
            logging.info("tfdp: balanced batches after step %d: shares %s -> %s (step seconds "
                         "a + b x share: a %s, b %s)", self.steps, before, new.shares,
                         [f"{a:.3g}" for a in self.planner.fixed_seconds],
                         [f"{c:.3g}" for c in self.planner.seconds_per_example])
        return new

    def set_global_batch(self, global_batch: int | None) -> None:
        """Before training: equal shares of a known global batch (unless `shares` were given)."""
        if self.planner is None and self.options.shares is None and global_batch:
            plan = batch_shares.equal_plan(global_batch, self.num_replicas)
            self.plan.assign(plan.shares)

    def reset_timings(self) -> None:
        self.totals.assign(tf.zeros_like(self.totals))
        self.exchange_totals.assign(tf.zeros_like(self.exchange_totals))

    def replan(self) -> batch_shares.SharePlan | None:
        """Reads and clears the timings, plans, and assigns the plan variable if it changed.

        Returns:
            The new plan, or None (no timings, or too small a gain).
        """
        totals = self.totals.numpy()
        exchange = self.exchange_totals.numpy()
        self.reset_timings()
        r = self.num_replicas
        seconds, examples, steps = totals[:r], totals[r:2 * r], totals[2 * r]
        if steps < 1 or min(examples) < 1:
            return None
        whole = None
        if exchange[r] >= 1:  # a worker's step: its busy seconds and its exchange's
            whole = float(max(seconds[w] / steps + exchange[w] / exchange[r]
                              for w in range(r))) * steps
        if self.planner is None:
            current = [int(s) for s in self.plan.numpy()]
            global_batch = sum(current)
            if self.options.shares is None and global_batch == r:  # only proportions known
                global_batch = max(r, int(round(float(sum(examples)) / steps)))
                current = list(batch_shares.equal_plan(global_batch, r).shares)
            self.planner = batch_shares.SharePlanner(
                global_batch=global_batch, num_workers=r, replan_every=1,
                smoothing=self.options.smoothing, min_gain=self.options.min_gain)
            self.planner.plan = batch_shares.SharePlan(tuple(current))
        self.planner.observe([float(s) for s in seconds], [float(e) for e in examples],
                             steps=int(round(float(steps))), whole_step_seconds=whole)
        new = self.planner.replan()
        if new is not None:
            self.plan.assign(new.shares)
            self.history.append((self.steps, new.shares))
        return new


def _tensors(nest) -> list:
    return [t for t in tf.nest.flatten(nest) if tf.is_tensor(t)]


class Clock:
    """A replica's timestamp at the start of its compute, and the spans to leave out of it."""

    def __init__(self, start: tf.Tensor):
        self.start = start
        self.excluded: list[tf.Tensor] = []

    def excluding(self, fn, value):
        """`fn(value)` (a collective inside the timed span), its seconds left out of the time."""
        with tf.control_dependencies(_tensors(value)):
            before = tf.timestamp()
        with tf.control_dependencies([before]):
            value = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), value)
        result = fn(value)
        with tf.control_dependencies(_tensors(result) or [before]):
            after = tf.timestamp()
        self.excluded.append(after - before)
        return result

    def end(self, outputs) -> tf.Tensor:
        """float64 timestamp of when every tensor of `outputs` is ready."""
        flat = [g.values if isinstance(g, tf.IndexedSlices) else g for g in outputs]
        with tf.control_dependencies(flat):
            return tf.timestamp()

    def seconds(self, start: tf.Tensor, end: tf.Tensor) -> tf.Tensor:
        """float32 seconds from `start` to `end`, the excluded spans (all inside them) left out."""
        seconds = end - start - tf.add_n(self.excluded) if self.excluded else end - start
        return tf.cast(tf.maximum(seconds, 0.0), tf.float32)

    def stop(self, outputs) -> tf.Tensor:
        """float32 seconds from the start to when every tensor of `outputs` is ready."""
        return self.seconds(self.start, self.end(outputs))


class Replanner(keras.callbacks.Callback):
    """`fit`'s hook: `BalancedBatches.begin` at the start, `after_steps` after each execution.

    The steps are counted on the host from the batch indices Keras passes, so
    every worker plans after the same step.
    """

    def __init__(self, balance: BalancedBatches, *, log: bool):
        super().__init__()
        self.balance = balance
        self.log = log
        self._begin = 0

    def on_train_begin(self, logs=None):
        self.balance.begin()

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        self.balance.after_steps(batch - self._begin + 1, log=self.log)
