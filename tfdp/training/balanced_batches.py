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
- **the clock.** Each replica measures its compute seconds for the step with
  `tf.timestamp` around its forward and backward pass (from its slice to its
  gradients, a counts all-reduce inside the pass excluded), before the
  gradient all-reduce. Its seconds and examples, at its own position of a
  `[2 × replicas]` vector (zeros elsewhere), ride in the gradients' own
  all-reduce (`OptimizerStep.carrying`): no collective of their own. Every
  replica adds the sums to the same accumulator.
- **the re-planner** (`after_steps`, run between executions by `Replanner`,
  a Keras callback `fit` runs, and by `tfdp.Trainer`'s loops): every
  `replan_every` steps, at the end of an execution of the train function, it
  reads the accumulated seconds, examples and steps, feeds the window's mean
  share and mean seconds per step to a
  `tfdp.training.batch_shares.SharePlanner` (an affine model, seconds =
  a fixed cost per step + a cost per example x share, fitted to the recent
  windows, the newest weighted most; a new plan only when it predicts a step
  at least `min_gain` shorter) and assigns the plan variable. Every worker reads
  the same all-reduced sums at the same step, so every worker computes the
  same plan with no collective. The first execution's timings (warm-up) are
  dropped.

It does not own the planning arithmetic (`batch_shares`), the input's
replication (`replicated_input`), nor which options may be combined with it
(`tfdp.training.option_rules`).
"""

from __future__ import annotations

import dataclasses

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
            planning, each replica's compute seconds, each replica's
            examples, and the steps timed; equal on every replica.
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
        """float32 `[2 × replicas]`: this replica's seconds and examples at its own positions."""
        seconds = clock.stop([g for g in gradients if g is not None])
        context = tf.distribute.get_replica_context()
        position = tf.one_hot(tf.cast(context.replica_id_in_sync_group, tf.int32),
                              self.num_replicas, dtype=tf.float32)
        return tf.concat([position * seconds, position * tf.cast(examples, tf.float32)], 0)

    def add_sums(self, sums: tf.Tensor) -> None:
        """Adds one step's summed riders (and the step) to `totals`, on this replica's copy."""
        self.totals.assign_add(tf.concat([sums, tf.ones([1])], 0))

    # --- between executions (host) -------------------------------------------

    def begin(self) -> None:
        """At the start of a training run: the next execution's timings are warm-up."""
        self._warm = False
        self._since = 0

    def after_steps(self, steps: int, *, log: bool = False) -> batch_shares.SharePlan | None:
        """After an execution of `steps` steps: re-plans once `replan_every` steps have run.

        The first execution after `begin` only drops its timings (tracing and
        warm-up are not a speed). Every worker calls it after the same steps,
        so every worker re-plans at the same step.

        Returns:
            The new plan, or None.
        """
        self.steps += steps
        if not self._warm:
            self._warm = True
            self.reset_timings()
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

    def replan(self) -> batch_shares.SharePlan | None:
        """Reads and clears the timings, plans, and assigns the plan variable if it changed.

        Returns:
            The new plan, or None (no timings, or too small a gain).
        """
        totals = self.totals.numpy()
        self.reset_timings()
        r = self.num_replicas
        seconds, examples, steps = totals[:r], totals[r:2 * r], totals[2 * r]
        if steps < 1 or min(examples) < 1:
            return None
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
                             steps=int(round(float(steps))))
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

    def stop(self, outputs) -> tf.Tensor:
        """float32 seconds from the start to when every tensor of `outputs` is ready."""
        flat = [g.values if isinstance(g, tf.IndexedSlices) else g for g in outputs]
        with tf.control_dependencies(flat):
            end = tf.timestamp()
        seconds = end - self.start - tf.add_n(self.excluded) if self.excluded else end - self.start
        return tf.cast(tf.maximum(seconds, 0.0), tf.float32)


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
