"""Training steps with a NaN or Inf loss or gradient: skipped everywhere alike.

This module owns what happens to such a step, under every `tf.distribute`
strategy:

- **the decision**, the same on every replica and worker. The optimizer
  wrappers here all-reduce the gradients themselves (the one all-reduce the
  step has anyway), check the *summed* gradients, and only then let the
  wrapped optimizer apply them (`tfdp._upstream.keras_optimizer_reduction`).
  A NaN or Inf on any replica is in the sum every replica receives, and every
  TensorFlow all-reduce hands every replica the same sum, so all of them take
  the same branch: no extra collective, and a worker never waits alone in a
  collective the others skipped. The branch is a `tf.cond` in cross-replica
  context (through `merge_call`, as Keras' `LossScaleOptimizer._tf_apply`
  does), because Keras cannot run `apply_gradients` inside a `tf.cond` in
  replica context under MirroredStrategy (keras-team/keras#20582). A
  non-finite *loss* is folded into one gradient by `fold_loss_into_gradients`
  (tfdp's own train steps do this), so it is caught by the same check.
- **counting**: a skipped step leaves the weights, the optimizer slots and
  `optimizer.iterations` unchanged (so learning-rate schedules and
  `iterations` count applied updates only) and adds one to the wrapper's
  `skipped_steps` and `consecutive_skipped_steps` variables, which are
  optimizer variables and so are checkpointed and restored with it.
- **stopping**: after `max_consecutive_nonfinite` skips in a row the wrapper
  applies nothing more (it is "exhausted"). Reading the counters after each
  training call, logging skips and raising `NonFiniteError` at the limit is
  `tfdp.training.step_monitor`'s, as is refusing to save non-finite weights.

It does not own when steps run or checkpoints are saved (`tfdp.Trainer`,
`tfdp.compile` with `tfdp.callbacks.BackupAndRestore`).

Not undone by a skip: what the forward pass itself updates (metrics,
`BatchNormalization` moving statistics, any layer state assigned in `call`).
The skipped step's loss enters the logged mean (NaN), and a NaN input leaves
NaN moving statistics, which `check_finite_before_save` then refuses to save.

Cost per optimizer step: no collective; one `is_finite` reduction over the
summed gradients (one read of them, like one elementwise op) and a `tf.cond`.
Gradient clipping (`clipnorm`, `global_clipnorm`) of the wrapped optimizer
then applies to the summed gradient, as on one device, instead of each
replica's share as Keras' own `apply` under a strategy does.
"""

from __future__ import annotations

import contextlib

import math
from typing import Sequence

import keras
import tensorflow as tf

from tfdp.distribute import compression
from tfdp.distribute import compressor_config
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.distribute import optimizer_sharding
from tfdp.distribute import reduction
from tfdp.distribute import replica_cond
from tfdp.training import option_rules
from tfdp._upstream import keras_optimizer_internals
from tfdp._upstream import keras_optimizer_reduction
from tfdp._upstream import loss_scale

#: Values of the `nonfinite` argument of `tfdp.Trainer` and `tfdp.compile`
#: (`None` turns the handling off).
MODES = ("skip", "raise")
#: Default `max_consecutive_nonfinite`.
DEFAULT_MAX_CONSECUTIVE = 10
#: The limit under `mixed_float16` with `nonfinite=None`: skip overflowing
#: steps forever, as Keras' loss scaling does.
NO_LIMIT = 2**62

class NonFiniteError(FloatingPointError):
    """Training stopped: too many non-finite steps in a row, or non-finite weights."""


def check_arguments(nonfinite, max_consecutive_nonfinite, all_reduce_dtype=None,
                    compressor=None, local_sync=None, shard_optimizer_state=False) -> None:
    """Validates `nonfinite`, `max_consecutive_nonfinite`, `all_reduce_dtype`, `compressor`, `local_sync`, `shard_optimizer_state`.

    Each value alone (`check_values`), then every pair of them
    (`tfdp.training.option_rules`).

    Raises:
        ValueError: one is invalid, or a pair of them is refused by
            `tfdp.training.option_rules`.
    """
    check_values(nonfinite, max_consecutive_nonfinite, all_reduce_dtype, compressor,
                 shard_optimizer_state)
    option_rules.check(option_rules.TrainingOptions(
        nonfinite=nonfinite, all_reduce_dtype=all_reduce_dtype, compressor=compressor,
        sync_every=1 if local_sync is None else local_sync.sync_every,
        outer_optimizer=None if local_sync is None else local_sync.outer_optimizer,
        shard_optimizer_state=shard_optimizer_state))


def check_values(nonfinite, max_consecutive_nonfinite, all_reduce_dtype=None,
                 compressor=None, shard_optimizer_state=False) -> None:
    """Validates each of these arguments alone (their pairs: `tfdp.training.option_rules`).

    Raises:
        ValueError: one is invalid.
    """
    reduction.check_all_reduce_dtype(all_reduce_dtype)
    _check_compressor(compressor)
    if not isinstance(shard_optimizer_state, bool):
        raise ValueError("`shard_optimizer_state` must be True or False. "
                         f"Received: shard_optimizer_state={shard_optimizer_state!r}")
    if nonfinite is not None and nonfinite not in MODES:
        raise ValueError(
            "`nonfinite` must be 'skip' (skip and count a step whose loss or gradients "
            "are not finite; stop after max_consecutive_nonfinite in a row), 'raise' "
            "(stop at the first) or None (no handling). "
            f"Received: nonfinite={nonfinite!r}"
        )
    if (
        isinstance(max_consecutive_nonfinite, bool)
        or not isinstance(max_consecutive_nonfinite, int)
        or max_consecutive_nonfinite < 1
    ):
        raise ValueError(
            "`max_consecutive_nonfinite` must be a positive integer. "
            f"Received: max_consecutive_nonfinite={max_consecutive_nonfinite!r}"
        )


def _all_finite(gradients: Sequence[tf.Tensor]) -> tf.Tensor:
    checks = []
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            gradient = gradient.values
        checks.append(tf.reduce_all(tf.math.is_finite(gradient)))
    return tf.reduce_all(tf.stack(checks))


def _divide(gradient, scale):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values / tf.cast(scale, gradient.values.dtype),
            gradient.indices,
            gradient.dense_shape,
        )
    return gradient / tf.cast(scale, gradient.dtype)


class _SkipNonFinite:
    """The guarded `apply`; subclasses say what a finite step and a skip do.

    Needs `inner_optimizer`, `max_consecutive_nonfinite` and the counters that
    `_build_counters` creates; `all_reduce_dtype` (see `tfdp.distribute.reduction`) is
    the dtype gradients are summed in, `None` for their own.
    """

    all_reduce_dtype: str | None = None
    compressor: compression.GradientCompressor | None = None
    local_sync: local_sync_lib.LocalSync | None = None
    sharding: optimizer_sharding.OptimizerSharding | None = None
    _pending_divisor = None

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether each replica keeps the inner optimizer's state for its share only (ZeRO-1)."""
        return self.sharding is not None

    @property
    def accepts_global_divisor(self) -> bool:
        """Whether `dividing_by_global` may be used: not under a compressor, whose
        error memories must hold gradients already divided by the global count,
        nor with local steps, which sum nothing, nor in bfloat16: the float32
        divisor cannot share a collective with bfloat16 gradients
        (MultiWorkerMirroredStrategy packs them into one concat), so the
        counts take their own small all-reduce instead."""
        return (self.compressor is None and self.local_sync is None
                and self.all_reduce_dtype is None)

    @property
    def steps_locally(self) -> bool:
        """Whether each replica applies its own gradients (local SGD / DiLoCo)."""
        return self.local_sync is not None

    def sync_pending(self) -> None:
        """With local steps, synchronises the replicas' weights now if they differ (else nothing)."""
        if self.local_sync is not None:
            self.local_sync.sync_pending()

    def _build_inner(self, var_list) -> None:
        """Builds the inner optimizer: on the variables, or on this replica's chunks of them."""
        if self.sharding is not None:
            self.sharding.build(self.inner_optimizer, var_list)
        else:
            self.inner_optimizer.build(var_list)

    def save_own_variables(self, store):
        """As Keras' (what `model.save()` writes), with sharded state laid out as unsharded."""
        if self.sharding is None or not self.sharding.active:
            return super().save_own_variables(store)
        state = self.sharding.unsharded_state(self.inner_optimizer)
        for i, variable in enumerate(self.variables):
            store[str(i)] = state[id(variable)] if id(variable) in state else variable.numpy()

    def load_own_variables(self, store):
        """As Keras' (`keras.models.load_model`): each replica takes its chunks of the saved state."""
        if self.sharding is None or not self.sharding.active:
            return super().load_own_variables(store)
        variables = self.variables
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"The saved optimizer has {len(store.keys())} variables; {type(self).__name__} "
                f"of this model has {len(variables)}. Load a file saved with the same optimizer "
                "and options (gradient_compression, sync_every).")
        inner = {id(v) for v in self.inner_optimizer.variables}
        state = {}
        for i, variable in enumerate(variables):
            if id(variable) in inner:
                state[id(variable)] = store[str(i)]
            else:
                variable.assign(store[str(i)])
        self.sharding.load_unsharded_state(self.inner_optimizer, state)

    def _build_local_sync(self, var_list) -> None:
        if self.local_sync is not None:
            self.local_sync.build(self, var_list)
            # An attribute of the wrapper, so that tf.train.Checkpoint tracks
            # the outer optimizer's slots as it tracks the inner optimizer's.
            if self.local_sync.outer_optimizer is not None:
                self.outer_optimizer = self.local_sync.outer_optimizer

    @contextlib.contextmanager
    def dividing_by_global(self, local_divisor: tf.Tensor, local_scale: tf.Tensor):
        """Within it, `apply` rescales each replica's gradients and divides their sum by a global divisor.

        Each replica's gradients are multiplied by `local_scale`, summed, and
        divided by `local_divisor` summed over replicas, which rides in the
        gradients' own all-reduce (exactly, in float32): a loss whose global
        normaliser is not known before the backward pass
        (`tfdp.training.loss_normalization`) costs no extra collective, and
        its backward pass runs at the loss's usual magnitude (what float16
        needs). Used at trace time, around `apply_gradients`.

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

    def _build_counters(self) -> None:
        # aggregation="none": every replica computes the same value, and each
        # updates its own copy without a collective (as Keras' loss scale).
        self.skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none",
            name="skipped_steps",
        )
        self.consecutive_skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none",
            name="consecutive_skipped_steps",
        )

    def _exhausted(self) -> tf.Tensor:
        return self.consecutive_skipped_steps >= self.max_consecutive_nonfinite

    def apply(self, grads, trainable_variables=None):
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
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError(f"{type(self).__name__}.apply() must be called in a replica context.")
        local = self.local_sync is not None
        reduced = context.num_replicas_in_sync > 1 and not local
        if local:
            self.local_sync.before_step()
        divisor = self._pending_divisor
        if divisor is not None:
            divisor, scale = divisor
            divisor = tf.reshape(tf.cast(divisor, tf.float32), [1])
            grads = [_divide(g, 1.0 / tf.cast(scale, tf.float32)) for g in grads]
        new_state = None
        sharded = self.sharding is not None and self.sharding.active
        # ZeRO-1 with plain gradients: each replica receives only its chunks
        # (reduce-scatter), never the whole sum.
        scattered = (sharded and reduced and self.compressor is None
                     and self.all_reduce_dtype is None and self.sharding.scatters)
        if scattered:
            grads, variables = self.sharding.reduce_scatter_gradients(context, grads, variables)
            if divisor is not None:
                (divisor,) = reduction.all_reduce_sum(context, [divisor])
        elif reduced and self.compressor is not None:
            if divisor is not None:
                raise ValueError("dividing_by_global cannot be used with a gradient compressor.")
            grads, new_state = self._compressed_sum(context, grads, variables)
        elif reduced and divisor is not None:
            grads, (divisor,) = reduction.all_reduce_sum(
                context, grads, self.all_reduce_dtype, exact=[divisor]
            )
        elif reduced:
            grads = reduction.all_reduce_sum(context, grads, self.all_reduce_dtype)
        if divisor is not None:
            grads = [_divide(g, tf.math.maximum(divisor[0], 1e-30)) for g in grads]
        if scattered:
            # Each replica holds its chunks only: one all-reduce of the
            # non-finite chunk counts gives every replica the same verdict.
            (nonfinite,) = reduction.all_reduce_sum(
                context, [tf.reshape(1.0 - tf.cast(_all_finite(grads), tf.float32), [1])])
            finite = nonfinite[0] == 0.0
        else:
            # The same value on every replica and worker: computed from the same sums.
            finite = _all_finite(grads)
        proceed = tf.logical_and(finite, tf.logical_not(self._exhausted()))
        if new_state is not None:
            # A skipped step leaves the error memories as they were.
            self.compressor.commit(new_state, proceed)

        # A compressor's sums are of gradients it unscaled first (_compressed_sum).
        unscaled = reduced and self.compressor is not None
        if sharded:
            # Outside the branch, so a skipped step gathers the weights unchanged.
            self.sharding.load_weights(context)
            if not scattered:
                grads, variables = self.sharding.shard_gradients(context, grads, variables)
            if self.sharding.terms is not None:
                # LARS, LAMB: their whole-variable norms, summed over the
                # chunks, before the branch (a collective; the same on every
                # replica, unused when the step is skipped).
                self.sharding.sum_norm_terms(
                    context, self.inner_optimizer,
                    self._inner_gradients(grads, variables, unscaled), variables)

        def apply_step(grads):
            if reduced or local:
                with keras_optimizer_reduction.gradients_already_reduced(self.inner_optimizer):
                    self._apply_finite(grads, variables, unscaled)
            else:
                self._apply_finite(grads, variables, unscaled)

        if keras_optimizer_internals.supports_no_merge_call():
            tf.cond(proceed, lambda: apply_step(grads), self._skip)
        else:
            def cross_replica(distribution, grads, proceed):
                # Keras' update merge_calls, which cannot sit in a tf.cond in
                # replica context: branch here, in cross-replica context.
                # Equal on every replica unless they step locally: then this
                # worker's replicas skip together if any of them must.
                proceed = tf.reduce_all(tf.stack(distribution.experimental_local_results(proceed)))
                tf.cond(
                    proceed,
                    lambda: distribution.extended.call_for_each_replica(apply_step, args=(grads,)),
                    self._skip,
                )

            context.merge_call(cross_replica, args=(grads, proceed))
        if sharded:
            self.sharding.gather_weights(context)
        if local:
            self.local_sync.after_step(context)

    def _compressed_sum(self, context, grads, variables):
        """`(estimated sums, new compressor state)` for `grads` of `variables`.

        The compressor sees one dense gradient per variable it was built for
        (zeros where none was given this step), unscaled when the loss is.
        """
        built = keras_optimizer_internals.built_variables(self)
        given = {id(v): g for g, v in zip(grads, variables)}
        scale = self._compression_scale()
        dense = []
        for variable in built:
            gradient = given.get(id(variable))
            if gradient is None:
                gradient = tf.zeros(variable.shape, variable.dtype)
            elif isinstance(gradient, tf.IndexedSlices):
                gradient = tf.convert_to_tensor(gradient)
            dense.append(gradient if scale is None else _divide(gradient, scale))
        start_step = getattr(self.compressor, "start_step", 0)

        def compressed(dense):
            return self.compressor.reduce(tf.distribute.get_replica_context(), dense,
                                          self.all_reduce_dtype)

        if start_step:
            # Before start_step: the plain all-reduce, state unchanged. Every
            # replica takes the same branch (iterations is the same everywhere).
            def plain(dense):
                return (reduction.all_reduce_sum(tf.distribute.get_replica_context(), dense,
                                                 self.all_reduce_dtype),
                        [v.read_value() for v in self.compressor.state])

            sums, new_state = replica_cond.replica_cond(context, self.iterations < start_step, plain,
                                            compressed, dense)
        else:
            sums, new_state = compressed(dense)
        by_variable = {id(v): s for v, s in zip(built, sums)}
        return [by_variable[id(v)] for v in variables], new_state

    def _compression_scale(self):
        """What divides the gradients before compression (the loss scale), or None."""
        return None

    def _count_skip(self, counts_in_a_row) -> None:
        live = tf.logical_not(self._exhausted())
        self.skipped_steps.assign_add(tf.cast(live, "int64"))
        self.consecutive_skipped_steps.assign_add(
            tf.cast(tf.logical_and(live, counts_in_a_row), "int64")
        )


@keras.saving.register_keras_serializable(package="tfdp")
class NonFiniteGuard(_SkipNonFinite, keras.optimizers.Optimizer):
    """Wraps an optimizer; a step with non-finite gradients is skipped on every replica.

    A skipped step changes nothing but the counters: not the weights, not the
    slots, not `iterations` (which is the wrapped optimizer's, as are
    `learning_rate` and `scale_loss`).

    Args:
        inner_optimizer: the Keras optimizer that applies finite steps; must
            not set Keras' `gradient_accumulation_steps`.
        max_consecutive_nonfinite: after this many skipped steps in a row, no
            further step is applied (training should stop: `StepMonitor`).
            Defaults to 10.
        name: the wrapper's name. Defaults to `"nonfinite_guard"`.
        all_reduce_dtype: `None` (default) sums gradients over replicas in
            their own dtype; `"bfloat16"` sends half the bytes
            (`tfdp.distribute.reduction`).

    Attributes:
        skipped_steps: int64 variable, steps skipped so far.
        consecutive_skipped_steps: int64 variable, skipped since the last
            applied step.

    Raises:
        ValueError: `max_consecutive_nonfinite` is not a positive integer, or
            the inner optimizer accumulates gradients itself.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE,
        name: str | None = None,
        all_reduce_dtype: str | None = None,
        compressor: compression.GradientCompressor | None = None,
        local_sync: local_sync_lib.LocalSync | dict | None = None,
        shard_optimizer_state: bool = False,
        **kwargs,
    ):
        compressor = compressor_config.deserialize(compressor) if isinstance(compressor, dict) else compressor
        local_sync = _local_sync_of(local_sync)
        check_arguments("skip", max_consecutive_nonfinite, all_reduce_dtype, compressor,
                        local_sync, shard_optimizer_state)
        if getattr(inner_optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The optimizer sets Keras' own `gradient_accumulation_steps`, which "
                "NonFiniteGuard cannot wrap; accumulate with tfdp (accum_steps) instead."
            )
        if kwargs:
            raise ValueError(f"NonFiniteGuard does not support arguments: {sorted(kwargs)}.")
        super().__init__(learning_rate=0.0, name=name or "nonfinite_guard")
        self.inner_optimizer = inner_optimizer
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.all_reduce_dtype = all_reduce_dtype
        self.compressor = compressor
        self.local_sync = local_sync
        self.sharding = _sharding_of(shard_optimizer_state, inner_optimizer)

    def build(self, var_list):
        self._build_counters()
        self._build_inner(var_list)
        if self.compressor is not None:
            self.compressor.build(var_list)
        self._build_local_sync(var_list)
        super().build(var_list)

    def _inner_gradients(self, grads, variables, unscaled=False):
        """The gradients the inner optimizer applies (no loss scale: `grads`)."""
        del variables, unscaled
        return grads

    def _apply_finite(self, grads, variables, unscaled=False):
        self.inner_optimizer.apply(self._inner_gradients(grads, variables, unscaled), variables)
        self.consecutive_skipped_steps.assign(0)

    def _skip(self):
        self._count_skip(True)

    @property
    def variables(self):
        return (keras_optimizer_internals.own_variables(self) + self.inner_optimizer.variables
                + _outer_variables(self))

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("NonFiniteGuard runs on the TensorFlow backend only (no stateless_apply).")

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "max_consecutive_nonfinite": self.max_consecutive_nonfinite,
            "all_reduce_dtype": self.all_reduce_dtype,
            "compressor": compressor_config.serialize(self.compressor),
            "local_sync": None if self.local_sync is None else self.local_sync.get_config(),
            "shard_optimizer_state": self.sharding is not None,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


@keras.saving.register_keras_serializable(package="tfdp")
class NonFiniteLossScaleOptimizer(_SkipNonFinite, loss_scale.LossScaleOptimizer):
    """tfdp's `LossScaleOptimizer` (for `mixed_float16`) that counts and bounds skips.

    As `keras.optimizers.LossScaleOptimizer`: a step whose scaled gradients
    overflow is skipped and halves the loss scale; `dynamic_growth_steps`
    finite steps in a row double it. The decision is taken from the summed
    gradients, like `NonFiniteGuard` (no extra collective). Every skip counts
    in `skipped_steps`; it counts toward `consecutive_skipped_steps` (and its
    limit) only when the loss scale was already at most 1: above that, an
    overflow is the scale adjusting, which a lower scale fixes. A NaN that no
    scale fixes therefore stops training after about log2(scale) +
    `max_consecutive_nonfinite` steps.

    Args:
        inner_optimizer, initial_scale, dynamic_growth_steps, name: as for
            `keras.optimizers.LossScaleOptimizer`.
        max_consecutive_nonfinite: as for `NonFiniteGuard`. Defaults to 10.
        all_reduce_dtype: as for `NonFiniteGuard`. Defaults to `None`.
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        name=None,
        max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE,
        all_reduce_dtype: str | None = None,
        compressor: compression.GradientCompressor | None = None,
        local_sync: local_sync_lib.LocalSync | dict | None = None,
        shard_optimizer_state: bool = False,
        **kwargs,
    ):
        compressor = compressor_config.deserialize(compressor) if isinstance(compressor, dict) else compressor
        local_sync = _local_sync_of(local_sync)
        check_arguments("skip", max_consecutive_nonfinite, all_reduce_dtype, compressor,
                        local_sync, shard_optimizer_state)
        super().__init__(
            inner_optimizer, initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs,
        )
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.all_reduce_dtype = all_reduce_dtype
        self.compressor = compressor
        self.local_sync = local_sync
        self.sharding = _sharding_of(shard_optimizer_state, self.inner_optimizer)

    def build(self, var_list):
        self._build_counters()
        if self.compressor is not None:
            self.compressor.build(var_list)
        self._build_local_sync(var_list)
        # Keras' LossScaleOptimizer.build builds the inner optimizer on
        # var_list, which a Keras optimizer already built ignores.
        self._build_inner(var_list)
        super().build(var_list)

    def _compression_scale(self):
        # Error memories hold unscaled gradients, whatever the loss scale did since.
        return self.dynamic_scale

    def _inner_gradients(self, grads, variables, unscaled=False):
        """The gradients the inner optimizer applies: divided by the loss scale.

        `unscaled`: a compressor already divided them by it (see apply).
        """
        scale = 1.0 if unscaled else self.dynamic_scale
        return [
            g if getattr(v, "overwrite_with_gradient", False) else _divide(g, scale)
            for g, v in zip(grads, variables)
        ]

    def _apply_finite(self, grads, variables, unscaled=False):
        self.inner_optimizer.apply(self._inner_gradients(grads, variables, unscaled), variables)

        def grow():
            self.step_counter.assign(0)
            self.dynamic_scale.assign(self.dynamic_scale * 2.0)

        def count():
            self.step_counter.assign_add(1)

        tf.cond(tf.equal(self.step_counter, self.dynamic_growth_steps - 1), grow, count)
        self.consecutive_skipped_steps.assign(0)

    def _skip(self):
        live = tf.logical_not(self._exhausted())
        self._count_skip(self.dynamic_scale <= 1.0)
        self.step_counter.assign(0)
        self.dynamic_scale.assign(
            tf.where(live, self.dynamic_scale * 0.5, tf.convert_to_tensor(self.dynamic_scale))
        )

    def get_config(self):
        return {**super().get_config(), "max_consecutive_nonfinite": self.max_consecutive_nonfinite,
                "all_reduce_dtype": self.all_reduce_dtype,
                "compressor": compressor_config.serialize(self.compressor),
                "local_sync": None if self.local_sync is None else self.local_sync.get_config(),
                "shard_optimizer_state": self.sharding is not None}

    @property
    def variables(self):
        return super().variables + _outer_variables(self)


def _outer_variables(optimizer) -> list:
    local_sync = optimizer.local_sync
    return [] if local_sync is None else local_sync.outer_variables


def _sharding_of(shard_optimizer_state: bool, inner_optimizer):
    if not shard_optimizer_state:
        return None
    optimizer_sharding.check_optimizer(inner_optimizer)
    return optimizer_sharding.OptimizerSharding()


def _local_sync_of(local_sync):
    if isinstance(local_sync, dict):
        return local_sync_lib.LocalSync.from_config(local_sync)
    if local_sync is not None and not isinstance(local_sync, local_sync_lib.LocalSync):
        raise ValueError(
            "`local_sync` must be a tfdp.distribute.local_sync.LocalSync or None. "
            f"Received: local_sync={local_sync!r}"
        )
    return local_sync


def _check_compressor(compressor) -> None:
    if compressor is not None and not isinstance(compressor, (compression.GradientCompressor, dict)):
        raise ValueError(
            "`compressor` must be a tfdp.compression.PowerSGD or TopK, or None. "
            f"Received: compressor={compressor!r}"
        )


def wrap_optimizer(
    optimizer,
    *,
    nonfinite: str | None,
    max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE,
    loss_scaling: bool = False,
    all_reduce_dtype: str | None = None,
    compressor: compression.GradientCompressor | None = None,
    local_sync: local_sync_lib.LocalSync | None = None,
    shard_optimizer_state: bool = False,
):
    """The optimizer to train with, for a `nonfinite` mode.

    Call inside `strategy.scope()`.

    Args:
        optimizer: a Keras optimizer instance or name, possibly a Keras or
            tfdp `LossScaleOptimizer` (its inner optimizer, initial scale and
            growth steps are kept), or a wrapper from this module (returned as
            it is).
        nonfinite: `"skip"`, `"raise"` (a limit of 1) or `None` (no wrapper
            beyond loss scaling).
        max_consecutive_nonfinite: skipped steps in a row that stop training.
        loss_scaling: use dynamic loss scaling (the `mixed_float16` policy).
        all_reduce_dtype: the dtype gradients are summed over replicas in
            (`tfdp.distribute.reduction`); `None` for their own. Needs a wrapper, so not
            with `nonfinite=None`.
        compressor: a `tfdp.compression` compressor the gradients are summed
            through instead; needs a wrapper too.
        local_sync: a `tfdp.distribute.local_sync.LocalSync`: each replica
            steps on its own gradients and the weights are synchronised
            every `sync_every` steps (local SGD, DiLoCo); needs a wrapper.
        shard_optimizer_state: each replica keeps the inner optimizer's
            state for its share of the weights only
            (`tfdp.distribute.optimizer_sharding`, ZeRO-1); needs a wrapper.

    Returns:
        `NonFiniteLossScaleOptimizer` under loss scaling (with `nonfinite=None`
        too: it skips overflowing steps as Keras' loss scaling does, with no
        limit), else `NonFiniteGuard` (`None` mode: `optimizer` itself).

    Raises:
        ValueError: an argument is invalid, or `all_reduce_dtype` is set with
            `nonfinite=None`.
    """
    check_arguments(nonfinite, max_consecutive_nonfinite, all_reduce_dtype, compressor,
                    local_sync, shard_optimizer_state)
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, _SkipNonFinite):
        if all_reduce_dtype is not None:
            optimizer.all_reduce_dtype = all_reduce_dtype
        for name, value in (("gradient_compression", compressor), ("sync_every", local_sync)):
            if value is not None and optimizer.built:
                raise ValueError(f"Pass {name} before the optimizer is built.")
        if compressor is not None:
            optimizer.compressor = compressor
        if local_sync is not None:
            optimizer.local_sync = local_sync
        if shard_optimizer_state and optimizer.sharding is None:
            if optimizer.built:
                raise ValueError("Pass shard_optimizer_state before the optimizer is built.")
            optimizer.sharding = _sharding_of(True, optimizer.inner_optimizer)
        check_arguments(nonfinite, max_consecutive_nonfinite, optimizer.all_reduce_dtype,
                        optimizer.compressor, optimizer.local_sync,
                        optimizer.sharding is not None)
        return optimizer
    loss_scaling = loss_scaling or isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if nonfinite is None and not loss_scaling:
        return optimizer
    sharded = {"shard_optimizer_state": shard_optimizer_state}
    # Under loss scaling every mode takes the one decision path here: the
    # scaled gradients are all-reduced, checked once summed (the same on every
    # replica), unscaled, and then applied or skipped (halving the scale).
    # `None` skips as Keras' loss scaling does, without a limit, and counts the
    # skips, so `iterations + skipped_steps` stays the steps taken.
    limit = {"raise": 1, None: NO_LIMIT}.get(nonfinite, max_consecutive_nonfinite)
    if not loss_scaling:
        return NonFiniteGuard(optimizer, max_consecutive_nonfinite=limit,
                              all_reduce_dtype=all_reduce_dtype, compressor=compressor,
                              local_sync=local_sync, **sharded)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return NonFiniteLossScaleOptimizer(
            optimizer.inner_optimizer, initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name,
            max_consecutive_nonfinite=limit, all_reduce_dtype=all_reduce_dtype,
            compressor=compressor, local_sync=local_sync, **sharded,
        )
    return NonFiniteLossScaleOptimizer(
        optimizer, name="loss_scale_optimizer", max_consecutive_nonfinite=limit,
        all_reduce_dtype=all_reduce_dtype, compressor=compressor, local_sync=local_sync,
        **sharded,
    )


def guard_of(optimizer) -> _SkipNonFinite | None:
    """`optimizer` if it skips non-finite steps (a wrapper from here), else `None`."""
    return optimizer if isinstance(optimizer, _SkipNonFinite) else None


def _static_size(gradient) -> float:
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    size = values.shape.num_elements()
    return math.inf if size is None else size


def fold_loss_into_gradients(loss: tf.Tensor, gradients: Sequence) -> list:
    """`gradients`, with the smallest present one NaN when `loss` is not finite.

    A non-finite loss usually makes the gradients non-finite, but not always
    (a term that does not depend on the weights). Adding 0 (finite loss) or
    NaN to one gradient lets the wrapper see it in the summed gradients.
    Applied to the gradients, after `tape.gradient`, so that a variable the
    loss does not depend on keeps its `None` gradient and the optimizer
    leaves it alone, as Keras does.

    Args:
        loss: the scalar loss the gradients are of.
        gradients: one gradient (tensor, `tf.IndexedSlices` or `None`) per
            variable.

    Returns:
        The gradients (a list), equal to `gradients` when `loss` is finite.
    """
    gradients = list(gradients)
    present = [i for i, g in enumerate(gradients) if g is not None]
    if not present:
        return gradients
    index = min(present, key=lambda i: _static_size(gradients[i]))
    gradient = gradients[index]
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    flag = tf.where(tf.math.is_finite(loss), tf.zeros_like(loss),
                    tf.fill(tf.shape(loss), math.nan))
    values = values + tf.cast(flag, values.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    gradients[index] = values
    return gradients
