"""`NonFiniteLossScaleOptimizer`: dynamic loss scaling (`mixed_float16`) whose skips are counted and bounded.

The wrapper tfdp trains with under loss scaling, in every `nonfinite` mode.
Its step is `tfdp.training.optimizer_step`'s (exchange -> verdict -> apply ->
finish) on the *scaled* gradients: the verdict is taken from their sums,
the same on every replica, so the upstream fix of
`tfdp._upstream.loss_scale` (one more all-reduce for the verdict) is never
reached. This module owns the loss scale: the gradients the inner optimizer
applies are divided by it (`inner_gradients`), a finite step counts toward
doubling it, a skip halves it. Registered as
`tfdp>NonFiniteLossScaleOptimizer` for `.keras` files.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdp._upstream import loss_scale
from tfdp.distribute import compression
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.training import exchange_options
from tfdp.training import optimizer_step
from tfdp.training import verdict


@keras.saving.register_keras_serializable(package="tfdp")
class NonFiniteLossScaleOptimizer(optimizer_step.OptimizerStep, loss_scale.LossScaleOptimizer):
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
        all_reduce_dtype, compressor, local_sync, shard_optimizer_state,
            bucket_cap_mb: as for `NonFiniteGuard`. Default to `None`, `None`,
            `None`, False, `None`.
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        name=None,
        max_consecutive_nonfinite: int = verdict.DEFAULT_MAX_CONSECUTIVE,
        all_reduce_dtype: str | None = None,
        compressor: compression.GradientCompressor | None = None,
        local_sync: local_sync_lib.LocalSync | dict | None = None,
        shard_optimizer_state: bool = False,
        bucket_cap_mb: float | None = None,
        **kwargs,
    ):
        options = exchange_options.ExchangeOptions.checked(
            max_consecutive_nonfinite, all_reduce_dtype, compressor, local_sync,
            shard_optimizer_state, bucket_cap_mb)
        super().__init__(
            inner_optimizer, initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs,
        )
        self._adopt(options, self.inner_optimizer)

    def build(self, var_list):
        self._build_counters()
        self._build_exchange(var_list)
        # Keras' LossScaleOptimizer.build builds the inner optimizer on
        # var_list, which a Keras optimizer already built ignores.
        self.exchange.build_inner(var_list)
        super().build(var_list)

    def verdict_variables(self) -> list:
        """The counters, and the loss scale and its growth counter, which skips change."""
        return super().verdict_variables() + [self.dynamic_scale, self.step_counter]

    def gradient_scale(self):
        """The loss scale: exchanges that keep memories (compressors) hold unscaled gradients."""
        return self.dynamic_scale

    def inner_gradients(self, grads, variables, unscaled=False):
        """The gradients the inner optimizer applies: divided by the loss scale.

        `unscaled`: the exchange already divided them by it (`Step.unscaled`).
        """
        scale = 1.0 if unscaled else self.dynamic_scale
        return [
            g if getattr(v, "overwrite_with_gradient", False) else optimizer_step.divide(g, scale)
            for g, v in zip(grads, variables)
        ]

    def _apply_finite(self, grads, variables, unscaled=False):
        self.inner_optimizer.apply(self.inner_gradients(grads, variables, unscaled), variables)

        def grow():
            self.step_counter.assign(0)
            self.dynamic_scale.assign(self.dynamic_scale * 2.0)

        def count():
            self.step_counter.assign_add(1)

        tf.cond(tf.equal(self.step_counter, self.dynamic_growth_steps - 1), grow, count)
        self.consecutive_skipped_steps.assign(0)

    def _skip(self):
        live = tf.logical_not(self.exhausted())
        self._count_skip(self.dynamic_scale <= 1.0)
        self.step_counter.assign(0)
        self.dynamic_scale.assign(
            tf.where(live, self.dynamic_scale * 0.5, tf.convert_to_tensor(self.dynamic_scale))
        )

    def get_config(self):
        return {**super().get_config(), **exchange_options.config_of(self)}

    @property
    def variables(self):
        return super().variables + self.exchange.extra_optimizer_variables
