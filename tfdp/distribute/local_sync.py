"""Local SGD and DiLoCo: replicas step on their own, and meet every `sync_every` steps.

Between synchronisations each replica applies its own gradients (of its own
share of the batch, normalised by its own counts) with the inner optimizer:
no gradient all-reduce at all. The replicas' copies of every weight and
optimizer slot drift apart (each component of a `MirroredVariable` is
updated on its own, as Keras' optimizer updates each one with that replica's
gradient). Every `sync_every` steps the replicas all-reduce their weights in
one batched collective (float32, exact) and then:

- **local SGD** (`outer_optimizer=None`; Stich 2019, Lin et al. 2020): every
  replica takes the average;
- **DiLoCo** (Douillard et al. 2023, Algorithm 1): the pseudo-gradient
  `anchor − average` (`anchor`: the weights at the previous
  synchronisation) is applied to the anchor by the outer optimizer (SGD with
  Nesterov momentum in the paper) on every replica alike.

The inner optimizers' slots are never averaged (as in the paper). The step
counter since the last synchronisation, the anchors and the outer optimizer's
slots are equal on every replica and live in the wrapper's variables, so
they are checkpointed with the optimizer.

Stopping. Each replica decides on its own whether to skip a non-finite
step (there is no per-step collective to agree on it), so one replica may
reach the limit of skips in a row while the others train on. Its request to
stop rides in the next synchronisation's all-reduce (one more float32
value, no collective of its own), which sets `stopped` on every replica
alike; the training loops raise on `stopped`, so every worker stops after
the same step instead of one raising while the others wait in the next
collective.

This module owns the synchronisation; the local-step exchange
(`tfdp.training.exchanges.local_steps`) of tfdp's optimizer wrappers
calls it after each local step, and `sync_pending` at the points where
weights must be the same everywhere (ends of epochs, evaluation, the end of
training). Checkpoints do not synchronise: tfdp's save every replica's
weights (`tfdp.training.replica_state`), so a window runs on across a save.

`overlap=True` (`make`, or `overlap_sync=True` in `tfdp.compile` and
`tfdp.Trainer`) gives `OverlappedSync` instead
(`tfdp.distribute.overlapped_sync`): the all-reduce of a window runs in a
background thread while the next window computes, and is applied one
window late.
"""

from __future__ import annotations

from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfdp._upstream import keras_optimizer_reduction
from tfdp.distribute import overlapped_sync
from tfdp.distribute import reduction
from tfdp.distribute import replica_cond


def check_sync_every(sync_every) -> None:
    """Raises ValueError unless `sync_every` is a positive integer."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            "`sync_every` must be a positive integer: the local steps between two "
            "synchronisations of the replicas' weights (1: synchronous training). "
            f"Received: sync_every={sync_every!r}"
        )


def diloco_outer_optimizer(learning_rate: float = 0.7, momentum: float = 0.9):
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's lr 0.7, momentum 0.9)."""
    return keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum, nesterov=True,
                                name="outer_optimizer")


def check_overlap(overlap) -> None:
    """Raises ValueError unless `overlap` is a bool."""
    if not isinstance(overlap, bool):
        raise ValueError(
            "`overlap_sync` must be True (the weights' all-reduce of a window runs while the "
            "next window computes, and is applied one window late) or False. "
            f"Received: overlap_sync={overlap!r}"
        )


def make(sync_every: int, outer_optimizer=None, overlap: bool = False) -> "LocalSync":
    """A `LocalSync`, or with `overlap` its overlapped form (`tfdp.distribute.overlapped_sync`)."""
    check_overlap(overlap)
    if overlap:
        return OverlappedSync(sync_every, outer_optimizer)
    return LocalSync(sync_every, outer_optimizer)


def from_arguments(sync_every: int, outer_optimizer, overlap: bool = False) -> "LocalSync | None":
    """The `LocalSync` for the `sync_every`, `outer_optimizer` and `overlap_sync` arguments.

    `sync_every=1` without an outer optimizer is synchronous training, and
    takes exactly its path (one gradient all-reduce per step): None (the
    option rules refuse `overlap_sync=True` there).
    """
    check_sync_every(sync_every)
    check_overlap(overlap)
    if sync_every == 1 and outer_optimizer is None:
        return None
    return make(sync_every, outer_optimizer, overlap)


class LocalSync:
    """The synchronisation of replicas that train locally for `sync_every` steps.

    Args:
        sync_every: local optimizer steps between synchronisations (≥ 1).
        outer_optimizer: `None` for local SGD (the replicas' weights are
            averaged), or a Keras optimizer (instance or name) for DiLoCo's
            outer step.

    Attributes:
        overlap: whether the all-reduce overlaps the next window
            (`OverlappedSync`); False here.
    """

    overlap = False

    def __init__(self, sync_every: int, outer_optimizer=None):
        check_sync_every(sync_every)
        self.sync_every = sync_every
        self.outer_optimizer = (None if outer_optimizer is None
                                else keras.optimizers.get(outer_optimizer))
        self.steps_since_sync = None
        self.stopped = None  # see build(stop=...)
        self._stop = None
        self.anchors: list = []
        self._variables: list = []
        self._sync_function = None
        self._strategy = None

    def __repr__(self) -> str:
        return f"LocalSync(sync_every={self.sync_every}, outer_optimizer={self.outer_optimizer!r})"

    def build(self, owner: keras.optimizers.Optimizer, variables: Sequence,
              stop: Callable[[], tf.Tensor] | None = None) -> None:
        """Creates the counter (and DiLoCo's anchors and outer slots) as `owner`'s variables.

        Args:
            owner: the optimizer wrapper whose variables they are.
            variables: the weights to synchronise.
            stop: `None`, or a function returning, in replica context, a
                bool scalar: this replica asks the training to stop (the
                non-finite guard's limit). Each synchronisation carries it
                in the weights' all-reduce, and sets `stopped` on every
                replica when any replica asked.
        """
        self._variables = list(variables)
        self._stop = stop
        self._strategy = tf.distribute.get_strategy()  # build runs in the strategy's scope
        # aggregation="none": every replica computes the same value and
        # updates its own copy, without a collective.
        self.steps_since_sync = owner.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none",
            name="steps_since_sync",
        )
        if stop is not None:
            self.stopped = owner.add_variable(
                shape=(), dtype="int64", initializer="zeros", aggregation="none",
                name="stop_agreed",
            )
        if self.outer_optimizer is not None:
            if not self.outer_optimizer.built:
                # Made again here, inside the strategy's scope, whatever scope
                # the user's instance was created in (its config is all it
                # holds); eagerly, as build may run while a train step traces.
                with tf.init_scope():
                    self.outer_optimizer = type(self.outer_optimizer).from_config(
                        self.outer_optimizer.get_config())
            # add_variable (not add_variable_from_reference, which enters the
            # scope the owner was made in): the current strategy's scope.
            self.anchors = [
                owner.add_variable(shape=v.shape, dtype=v.dtype, initializer="zeros",
                                   aggregation="none", name=f"{_name(v)}_anchor")
                for v in variables
            ]
            self.outer_optimizer.build(self._variables)

    @property
    def weights(self) -> list:
        """The variables it synchronises (the wrapper's trainable variables; empty until built)."""
        return list(self._variables)

    @property
    def replica_variables(self) -> list:
        """Per-replica state besides the weights (the overlapped form's snapshots); none here."""
        return []

    def after_call(self) -> None:
        """Outside `tf.function`, after each call of the train function; nothing here (see overlapped_sync)."""

    def quiesce(self) -> None:
        """Outside `tf.function`: waits for a collective running in the background; none here."""

    @property
    def outer_variables(self) -> list:
        return [] if self.outer_optimizer is None else list(self.outer_optimizer.variables)

    def before_step(self) -> None:
        """At the start of a window, remembers the (synchronised) weights DiLoCo steps from."""
        if not self.anchors:
            return

        def remember():
            for anchor, variable in zip(self.anchors, self._variables):
                anchor.assign(variable)
            return tf.constant(True)

        # No collective inside: a plain cond in replica context.
        tf.cond(self._window_starts(), remember, lambda: tf.constant(False))

    def _window_starts(self) -> tf.Tensor:
        """A scalar bool: this step opens a window, so the anchor takes the weights."""
        return tf.equal(self.steps_since_sync, 0)

    def after_step(self, context: tf.distribute.ReplicaContext) -> None:
        """Counts a local step; after `sync_every` of them, synchronises (in replica context)."""
        self.steps_since_sync.assign_add(1)
        replica_cond.replica_cond(context, self.steps_since_sync >= self.sync_every,
                                  self._sync, _nothing, self._values())

    def _values(self) -> list:
        # Read in replica context, outside the branch, by tf.identity: under
        # MultiWorkerMirroredStrategy tf.convert_to_tensor of the variables
        # gives tensors with no device, which the all-reduce refuses
        # ("destinations can not be empty").
        values = [tf.identity(v) for v in self._variables]
        if self._stop is not None:  # this replica's request to stop, as 0.0 or 1.0
            values.append(tf.reshape(tf.cast(self._stop(), tf.float32), [1]))
        return values

    def _sync(self, values):
        context = tf.distribute.get_replica_context()
        sums = reduction.all_reduce_sum(context, values)  # one batched, exact collective
        if self._stop is not None:
            *sums, requests = sums
            # Equal on every replica: every worker stops after this same step.
            self.stopped.assign(tf.maximum(self.stopped, tf.cast(requests[0] > 0.0, tf.int64)))
        means = [s / tf.cast(context.num_replicas_in_sync, s.dtype) for s in sums]
        if self.outer_optimizer is None:
            for variable, mean in zip(self._variables, means):
                variable.assign(mean)
        else:
            pseudo_gradients = [anchor - mean for anchor, mean in zip(self.anchors, means)]
            for variable, anchor in zip(self._variables, self.anchors):
                variable.assign(anchor)
            # The pseudo-gradients are already equal on every replica.
            with keras_optimizer_reduction.gradients_already_reduced(self.outer_optimizer):
                self.outer_optimizer.apply(pseudo_gradients, self._variables)
        self.steps_since_sync.assign(0)

    def sync_pending(self) -> None:
        """Synchronises now if a local step was taken since the last synchronisation.

        Call from outside `tf.function` on every worker at the same point
        (ends of epochs, before evaluating or saving): it holds a collective
        when the counter is above zero, which it is equally everywhere.
        """
        if self.steps_since_sync is None:
            return  # not built: nothing was trained
        if self._sync_function is None:
            def replica_fn():
                context = tf.distribute.get_replica_context()
                replica_cond.replica_cond(context, self.steps_since_sync > 0, self._sync,
                                          _nothing, self._values())

            # Not converted by AutoGraph (nothing here branches on a tensor in
            # Python; the choice is replica_cond's tf.cond): converted, it
            # re-parsed the whole call tree on the first trace. Keras' fit
            # and tfdp's train steps are not converted either.
            self._sync_function = tf.function(lambda: self._strategy.run(replica_fn),
                                              autograph=False)
        self._sync_function()

    def get_config(self) -> dict:
        return {
            "sync_every": self.sync_every,
            "outer_optimizer": (None if self.outer_optimizer is None
                                else keras.saving.serialize_keras_object(self.outer_optimizer)),
        }

    @classmethod
    def from_config(cls, config: dict | None):
        if config is None:
            return None
        outer = config.get("outer_optimizer")
        if isinstance(outer, dict):
            outer = keras.saving.deserialize_keras_object(outer)
        return make(config["sync_every"], outer, config.get("overlap", False))


class OverlappedSync(overlapped_sync.Overlap, LocalSync):
    """`LocalSync` whose all-reduce overlaps the next window (`tfdp.distribute.overlapped_sync`)."""


def _name(variable) -> str:
    return getattr(variable, "path", variable.name).replace("/", "_").replace(":", "_")


def _nothing(_=()):
    return None
