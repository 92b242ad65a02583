"""`NonFiniteGuard`: a Keras optimizer wrapper that skips non-finite steps on every replica alike.

The wrapper tfdp trains with when there is no loss scaling. Its step is
`tfdp.training.optimizer_step`'s (exchange -> verdict -> apply -> finish);
this module says what a finite step and a skip do (apply with the inner
optimizer; count), and holds the Keras plumbing: the inner optimizer's
`learning_rate`, `iterations` and `scale_loss` are the wrapper's, and its
config round-trips through `.keras` files (registered as `tfdp>NonFiniteGuard`).
"""

from __future__ import annotations

import keras

from tfdp._upstream import keras_optimizer_internals
from tfdp.distribute import compression
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.training import exchange_options
from tfdp.training import optimizer_step
from tfdp.training import verdict


@keras.saving.register_keras_serializable(package="tfdp")
class NonFiniteGuard(optimizer_step.OptimizerStep, keras.optimizers.Optimizer):
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
        compressor: a `tfdp.compression` compressor (or its config) the
            gradients are summed through instead. Defaults to `None`.
        local_sync: a `tfdp.distribute.local_sync.LocalSync` (or its config):
            local SGD / DiLoCo. Defaults to `None`.
        shard_optimizer_state: ZeRO-1 (`tfdp.distribute.optimizer_sharding`).
            Defaults to False.
        bucket_cap_mb: `None` (default): one all-reduce after the backward
            pass; a number: PyTorch DDP's gradient buckets of at most that
            many MiB, each all-reduced as soon as its gradients exist
            (`tfdp.training.exchanges.bucketed`).

    Attributes:
        skipped_steps: int64 variable, steps skipped so far.
        consecutive_skipped_steps: int64 variable, skipped since the last
            applied step.

    Raises:
        ValueError: `max_consecutive_nonfinite` is not a positive integer, an
            option is invalid or refused with another
            (`tfdp.training.option_rules`), or the inner optimizer
            accumulates gradients itself.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        max_consecutive_nonfinite: int = verdict.DEFAULT_MAX_CONSECUTIVE,
        name: str | None = None,
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
        if getattr(inner_optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The optimizer sets Keras' own `gradient_accumulation_steps`, which "
                "NonFiniteGuard cannot wrap; accumulate with tfdp (accum_steps) instead."
            )
        if kwargs:
            raise ValueError(f"NonFiniteGuard does not support arguments: {sorted(kwargs)}.")
        super().__init__(learning_rate=0.0, name=name or "nonfinite_guard")
        self.inner_optimizer = inner_optimizer
        self._adopt(options, inner_optimizer)

    def build(self, var_list):
        self._build_counters()
        self.exchange.build_inner(var_list)
        self._build_exchange(var_list)
        super().build(var_list)

    def _apply_finite(self, grads, variables, unscaled=False):
        self.inner_optimizer.apply(self.inner_gradients(grads, variables, unscaled), variables)
        self.consecutive_skipped_steps.assign(0)

    def _skip(self):
        self._count_skip(True)

    @property
    def variables(self):
        return (keras_optimizer_internals.own_variables(self) + self.inner_optimizer.variables
                + self.exchange.extra_optimizer_variables)

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
            **exchange_options.config_of(self),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
