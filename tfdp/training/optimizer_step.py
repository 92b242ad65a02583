"""One guarded optimizer step: exchange -> verdict -> apply -> finish.

`OptimizerStep` is the `apply` that tfdp's two optimizer wrappers share
(`tfdp.training.guard_optimizer.NonFiniteGuard`,
`tfdp.training.loss_scaling.NonFiniteLossScaleOptimizer`):

1. **exchange**: the wrapper's exchange (`tfdp.training.exchanges`, picked
   from its options) makes each replica's gradients the ones it applies:
   summed (plain, bfloat16, compressed), reduce-scattered (ZeRO-1), or its
   own (local steps); a deferred global divisor is applied after it;
2. **verdict**: `tfdp.training.verdict` decides from the exchanged
   gradients, the same on every replica, whether the step is finite; it
   proceeds unless the limit of skips in a row is reached;
3. **apply**: a `tf.cond` (in cross-replica context where Keras' updates
   `merge_call`: keras-team/keras#20582) applies the gradients with the
   inner optimizer (`_apply_finite`) or counts a skip (`_skip`); the two
   subclasses say what those do (the loss scale grows or halves);
4. **finish**: the exchange's work after the branch, on every replica alike
   (ZeRO-1's gather, local steps' synchronisation).

A skipped step changes nothing but the counters: not the weights, the
slots, `iterations`, nor an exchange's state. Gradient clipping of the inner
optimizer applies to the summed gradient, as on one device.

It owns the order of the phases and the wrapper's delegating members; no
collective of its own.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfdp._upstream import keras_optimizer_internals
from tfdp._upstream import keras_optimizer_reduction
from tfdp.distribute import compression
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.distribute import optimizer_sharding
from tfdp.training import exchange_options
from tfdp.training import exchanges
from tfdp.training import keras_savers
from tfdp.training import verdict as verdict_lib


def divide(gradient, scale):
    """`gradient` (tensor or `tf.IndexedSlices`) divided by the scalar `scale`, in its dtype."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values / tf.cast(scale, gradient.values.dtype),
            gradient.indices,
            gradient.dense_shape,
        )
    return gradient / tf.cast(scale, gradient.dtype)


class OptimizerStep(verdict_lib.Counters):
    """The guarded `apply`; subclasses say what a finite step and a skip do.

    Needs `inner_optimizer` and `max_consecutive_nonfinite`. Its options
    pick the exchange (`exchange`): `all_reduce_dtype` (`None` or
    `"bfloat16"`), `compressor`, `local_sync` (local SGD, DiLoCo) and
    `sharding` (ZeRO-1) and `bucket_cap_mb` (the all-reduce in buckets during
    the backward pass).
    """

    all_reduce_dtype: str | None = None
    bucket_cap_mb: float | None = None
    compressor: compression.GradientCompressor | None = None
    local_sync: local_sync_lib.LocalSync | None = None
    sharding: optimizer_sharding.OptimizerSharding | None = None
    _pending_divisor = None
    _pending_riders = None

    @property
    def exchange(self) -> exchanges.Exchange:
        """The exchange of this wrapper's options (made on each read: it keeps no state itself)."""
        return exchanges.for_options(
            self, all_reduce_dtype=self.all_reduce_dtype, compressor=self.compressor,
            local_sync=self.local_sync, sharding=self.sharding,
            bucket_cap_mb=self.bucket_cap_mb)

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether each replica keeps the inner optimizer's state for its share only (ZeRO-1)."""
        return self.sharding is not None

    @property
    def accepts_global_divisor(self) -> bool:
        """Whether `dividing_by_global` may be used (`Exchange.accepts_global_divisor`): not
        under a compressor, whose error memories must hold gradients already divided by
        the global count, nor with local steps, which sum nothing, nor in bfloat16: the
        float32 divisor cannot share a collective with bfloat16 gradients
        (MultiWorkerMirroredStrategy packs them into one concat)."""
        return self.exchange.accepts_global_divisor

    @property
    def steps_locally(self) -> bool:
        """Whether each replica applies its own gradients (local SGD / DiLoCo)."""
        return self.exchange.steps_locally

    def sync_pending(self) -> None:
        """With local steps, synchronises the replicas' weights now if they differ (else nothing)."""
        self.exchange.sync_pending()

    def after_call(self) -> None:
        """Outside `tf.function`, after each call of the train function, on every worker (overlapped local steps)."""
        self.exchange.after_call()

    def quiesce(self) -> None:
        """Waits for a collective the exchange runs in the background (before a save launches one)."""
        self.exchange.quiesce()

    def _build_exchange(self, var_list) -> None:
        """Builds the exchange's per-replica state; tracks what it asks to be tracked."""
        exchange = self.exchange
        exchange.build(var_list)
        # Built in the strategy's scope: what model.save's warning needs later.
        self._built_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        for name, value in exchange.tracked_objects.items():
            setattr(self, name, value)

    def save_own_variables(self, store):
        """As Keras' (what `model.save()` writes); the exchange may lay its state out (ZeRO-1).

        Per-replica state it cannot keep (`Exchange.lost_by_keras_saves`) is
        warned about, once (`tfdp.training.keras_savers`).
        """
        keras_savers.warn_model_save(self, num_replicas=getattr(self, "_built_replicas", 1))
        self.exchange.save_own_variables(store, super().save_own_variables)

    def load_own_variables(self, store):
        """As Keras' (`keras.models.load_model`); the exchange may cut its state (ZeRO-1)."""
        self.exchange.load_own_variables(store, super().load_own_variables)

    @contextlib.contextmanager
    def dividing_by_global(self, local_divisor: tf.Tensor, local_scale: tf.Tensor):
        """Within it, `apply` rescales each replica's gradients and divides their sum by a global divisor.

        Each replica's gradients are multiplied by `local_scale`, summed, and
        divided by `local_divisor` summed over replicas, which rides in the
        gradients' own all-reduce (exactly, in float32): a loss whose global
        normaliser is not known before the backward pass
        (`tfdp.training.loss_normalization`) costs no extra collective, and
        its backward pass runs at the loss's usual magnitude (what float16
        needs). Used at trace time, around `apply_gradients`, when
        `accepts_global_divisor`.

        Args:
            local_divisor: float32 scalar, this replica's share of the
                divisor (e.g. its examples).
            local_scale: float32 scalar the replica's gradients are
                multiplied by first (what its loss was divided by).
        """
        self._pending_divisor = (local_divisor, local_scale)
        try:
            yield
        finally:
            self._pending_divisor = None

    @property
    def carries_riders(self) -> bool:
        """Whether `carrying` may be used (`Exchange.carries_riders`): the plain all-reduce in
        the gradients' own dtype only."""
        return self.exchange.carries_riders

    @contextlib.contextmanager
    def carrying(self, riders: tf.Tensor, on_sum):
        """Within it, `apply` sums `riders` over replicas in the gradients' own all-reduce.

        For per-step measurements every replica needs summed (the compute
        seconds of `tfdp.training.balanced_batches`): exactly, in float32,
        with no collective of their own. `on_sum` is called, in replica
        context and before the verdict (so also on a skipped step), with
        the sums, the same on every replica. Used at trace time, around
        `apply_gradients`, when `carries_riders`.

        Args:
            riders: float32 `[k]`, this replica's values.
            on_sum: called with the float32 `[k]` sums over all replicas.

        Raises:
            ValueError: the exchange cannot carry them (`carries_riders`).
        """
        if not self.carries_riders:
            raise ValueError(
                f"{type(self.exchange).__name__} cannot carry values in the gradients' "
                "all-reduce; only the plain all-reduce in the gradients' own dtype can.")
        self._pending_riders = (tf.reshape(tf.cast(riders, tf.float32), [-1]), on_sum)
        try:
            yield
        finally:
            self._pending_riders = None

    def _adopt(self, options: exchange_options.ExchangeOptions, inner_optimizer) -> None:
        """Takes the checked options both wrappers share (after Keras' `__init__`)."""
        self.max_consecutive_nonfinite = options.max_consecutive_nonfinite
        self.all_reduce_dtype = options.all_reduce_dtype
        self.compressor = options.compressor
        self.local_sync = options.local_sync
        self.bucket_cap_mb = options.bucket_cap_mb
        self.sharding = exchange_options.sharding_of(options.shard_optimizer_state,
                                                     inner_optimizer)

    def gradient_scale(self):
        """What the gradients reaching `apply` are multiplied by (the loss scale), or None."""
        return None

    def inner_gradients(self, grads, variables, unscaled=False):
        """The gradients the inner optimizer applies (no loss scale: `grads`)."""
        del variables, unscaled
        return grads

    def apply(self, grads, trainable_variables=None):
        """One step: exchange -> verdict -> apply or skip -> finish (in replica context)."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "Pass `trainable_variables` to the first apply(), or build the "
                    "optimizer first with optimizer.build(trainable_variables)."
                )
            trainable_variables = keras_optimizer_internals.built_variables(self)
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            return
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError(f"{type(self).__name__}.apply() must be called in a replica "
                             "context: call it inside strategy.run, or outside any strategy.")
        exchange = self.exchange
        step = exchanges.Step(context, [g for g, _ in pairs], [v for _, v in pairs])
        if self._pending_divisor is not None:
            divisor, scale = self._pending_divisor
            step = step.replace(
                divisor=tf.reshape(tf.cast(divisor, tf.float32), [1]),
                gradients=[divide(g, 1.0 / tf.cast(scale, tf.float32)) for g in step.gradients])
        on_riders_sum = None
        if self._pending_riders is not None:
            riders, on_riders_sum = self._pending_riders
            step = step.replace(riders=riders)

        step = exchange.exchange(step)
        if on_riders_sum is not None:
            on_riders_sum(step.riders)
        if step.divisor is not None:
            divisor = tf.math.maximum(step.divisor[0], 1e-30)
            step = step.replace(gradients=[divide(g, divisor) for g in step.gradients])
        proceed = tf.logical_and(verdict_lib.verdict(step), tf.logical_not(self.exhausted()))
        step = exchange.settle(step, proceed)
        self._apply_or_skip(step, proceed)
        exchange.finish(context)

    def _apply_or_skip(self, step, proceed) -> None:
        """`_apply_finite` where `proceed`, else `_skip`, on every replica alike."""
        variables, unscaled = step.variables, step.unscaled

        def apply_step(grads):
            if step.reduced:
                with keras_optimizer_reduction.gradients_already_reduced(self.inner_optimizer):
                    self._apply_finite(grads, variables, unscaled)
            else:
                self._apply_finite(grads, variables, unscaled)

        if keras_optimizer_internals.supports_no_merge_call():
            tf.cond(proceed, lambda: apply_step(step.gradients), self._skip)
            return

        def cross_replica(distribution, grads, proceed):
            # Keras' update merge_calls, which cannot sit in a tf.cond in
            # replica context: branch here, in cross-replica context. Equal
            # on every replica unless they step locally: then this worker's
            # replicas skip together if any of them must.
            proceed = tf.reduce_all(tf.stack(distribution.experimental_local_results(proceed)))
            tf.cond(
                proceed,
                lambda: distribution.extended.call_for_each_replica(apply_step, args=(grads,)),
                self._skip,
            )

        step.context.merge_call(cross_replica, args=(step.gradients, proceed))
