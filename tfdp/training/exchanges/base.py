"""The one interface of the gradient path: `Exchange`, and the `Step` it hands on.

An exchange is one way of getting each replica's gradients (or weights) to
where the inner optimizer applies them: summed by an all-reduce, compressed,
reduce-scattered into chunks (ZeRO-1), or not exchanged at all between the
synchronisations of local steps. tfdp's optimizer wrappers
(`tfdp.training.optimizer_step`) run one optimizer step as

    step = exchange.exchange(step)        # the collectives of the gradients
    finite = verdict.verdict(step)        # the same on every replica
    step = exchange.settle(step, proceed) # keep or drop state; chunks for ZeRO-1
    apply or skip                          # a tf.cond, equal on every replica
    exchange.finish(context)               # gather the chunks; synchronise weights

and never look inside an exchange: every member is a module of its own in
this package, and adding one touches none of the others.

This module owns the interface only: `Step` (what travels between the
phases) and `Exchange` (the phases, the per-replica state, the checkpoint
hooks). It owns no collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Step:
    """One replica's gradients on their way from the backward pass to the inner optimizer.

    Attributes:
        context: the replica context of the step.
        gradients: one gradient (tensor or `tf.IndexedSlices`) per entry of
            `variables`, in each variable's shape and dtype (or a `[S]`
            chunk of it once sharded), multiplied by the loss scale if any.
        variables: what the inner optimizer updates with them: the trainable
            variables, or their shard variables under ZeRO-1.
        divisor: `None`, or a float32 `[1]` tensor the gradients are divided
            by after the exchange (`dividing_by_global`): this replica's
            share before it, the sum over replicas after it.
        reduced: the gradients need no further reduction by the inner
            optimizer (they were summed, or each replica steps on its own).
        partial: each replica holds only its chunks of the summed gradients,
            so the verdict takes one all-reduce to be the same everywhere.
        unscaled: the gradients were already divided by the loss scale.
        pending: what the exchange commits in `settle` once the verdict is
            known (e.g. a compressor's new error memories), or `None`.
        riders: `None`, or a float32 `[k]` tensor summed over replicas in
            the gradients' own collective (`OptimizerStep.carrying`): this
            replica's values before it, the sums after it. Only an exchange
            that `carries_riders` takes it.
    """

    context: tf.distribute.ReplicaContext
    gradients: list
    variables: list
    divisor: tf.Tensor | None = None
    reduced: bool = False
    partial: bool = False
    unscaled: bool = False
    pending: Any = None
    riders: tf.Tensor | None = None

    def replace(self, **changes) -> "Step":
        """A copy with `changes` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)


class Exchange:
    """Base class of the ways gradients or weights cross replicas; every phase defaults to nothing.

    An exchange is made for one optimizer wrapper (`optimizer`, read for
    its inner optimizer, `iterations` and loss scale when needed) and built
    with it. Subclasses override the phases they need:

    - `build(variables)`: creates the per-replica state, in the strategy's
      scope, once, when the wrapper is built;
    - `build_inner(variables)`: builds the inner optimizer (ZeRO-1 builds it
      on chunks);
    - `exchange(step)`: the collectives that make each replica's gradients
      the ones it applies, before the verdict;
    - `settle(step, proceed)`: after the verdict (`proceed`, a bool scalar
      equal on every replica): commit or drop state, and hand the inner
      optimizer what it updates;
    - `finish(context)`: after the step was applied or skipped, on every
      replica alike (collectives allowed);
    - `sync_pending()`: outside `tf.function`, make the replicas' weights
      equal now if they differ (evaluation, ends of epochs);
    - `after_call()`: outside `tf.function`, after each call of the train
      function, on every worker alike (overlapped local steps end their
      windows here and start the all-reduce in a background thread);
    - `quiesce()`: outside `tf.function`, wait for any collective the
      exchange runs in the background, before the caller launches one
      (checkpoint saves).

    Attributes:
        state_variables: the variables whose value differs per replica,
            which tfdp's checkpoints save per replica
            (`tfdp.training.replica_state`); the one place checkpointing
            reads them from.
        state_repartitions: whether that state can be cut again for another
            number of replicas (ZeRO-1's chunks can; error memories cannot).
        lost_by_keras_saves: what of that state Keras' own savers
            (`model.save`, `keras.callbacks.ModelCheckpoint`,
            `keras.callbacks.BackupAndRestore`) do not keep, for a warning
            (`tfdp.training.keras_savers`); `None` when they keep it all.
        accepts_global_divisor: whether a `Step.divisor` may be given.
        carries_riders: whether `Step.riders` may be given: the exchange sums
            them, exactly in float32, in its collective of the gradients.
        scatterable: whether a sharded exchange may reduce-scatter instead
            of calling this exchange (only for a plain, lossless sum).
        steps_locally: each replica applies its own gradients.
        sharding: the `OptimizerSharding` of ZeRO-1, or `None`.
    """

    state_repartitions = True
    accepts_global_divisor = False
    carries_riders = False
    scatterable = False
    steps_locally = False
    sharding = None

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state_variables(self) -> list:
        return []

    @property
    def lost_by_keras_saves(self) -> str | None:
        return None

    @property
    def stop_variable(self):
        """`None`, or an int64 variable equal on every replica that is 1 once training must stop.

        For an exchange whose replicas decide their skips each on its own
        (local steps): the non-finite guard's limit reached on any replica,
        agreed at a synchronisation. The loops raise on it
        (`tfdp.training.step_monitor`) instead of on the per-replica counters.
        """
        return None

    @property
    def extra_optimizer_variables(self) -> list:
        """Variables the wrapper lists beside its own and the inner optimizer's (DiLoCo's outer slots)."""
        return []

    @property
    def tracked_objects(self) -> dict:
        """`{attribute: object}` the wrapper holds so that `tf.train.Checkpoint` tracks them."""
        return {}

    def build(self, variables: list) -> None:
        del variables

    def build_inner(self, variables: list) -> None:
        self.optimizer.inner_optimizer.build(variables)

    def exchange(self, step: Step) -> Step:
        return step

    def settle(self, step: Step, proceed: tf.Tensor) -> Step:
        del proceed
        return step

    def finish(self, context: tf.distribute.ReplicaContext) -> None:
        del context

    def sync_pending(self) -> None:
        pass

    def after_call(self) -> None:
        pass

    def quiesce(self) -> None:
        pass

    def save_own_variables(self, store, default: Callable) -> None:
        """What `model.save()` writes of the wrapper; `default` is Keras' own method."""
        default(store)

    def load_own_variables(self, store, default: Callable) -> None:
        """What `keras.models.load_model` reads into the wrapper; `default` is Keras' own method."""
        default(store)
