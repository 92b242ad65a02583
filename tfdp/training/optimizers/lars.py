"""The LARS optimizer (You, Gitman & Ginsburg, 2017) as a Keras 3 optimizer.

This module owns the LARS update rule only. Which variables get weight decay
and layer adaptation is decided in `tfdp.training.optimizers._exclusion`; gradient
aggregation across replicas, clipping, EMA, loss scaling and gradient
accumulation are the Keras base optimizer's, unchanged.

Keras has no LARS (TF 1's `tf.contrib.opt.LARSOptimizer` and TF Model
Garden's `tf_keras` LARS do not run on Keras 3), hence this file.
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf
from keras import ops

from tfdp import _checks
from tfdp._upstream import keras_optimizer_internals
from tfdp.training.optimizers._exclusion import LayerwiseExclusionMixin


@keras.saving.register_keras_serializable(package="tfdp")
class LARS(LayerwiseExclusionMixin, keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling: SGD with momentum and a trust ratio.

    For each variable `w` with (replica-aggregated) gradient `g`:

    ```
    wd    = weight_decay, or 0 if w is excluded from weight decay
    d     = g + wd * w
    trust = eeta * ||w|| / (||g|| + wd * ||w|| + epsilon)
            (1 if ||w|| == 0 or ||g|| == 0, or w is excluded from adaptation)
    v     = momentum * v + learning_rate * trust * d
    w     = w - v                                       # nesterov=False
    w     = w - (momentum * v + learning_rate * trust * d)   # nesterov=True
    ```

    `||.||` is the L2 norm over the whole variable. Under a
    `tf.distribute` strategy the norms are taken on the mirrored variable and
    the all-reduced gradient, so every replica applies the same update as a
    single device would with the global batch. A variable excluded from
    weight decay but not from adaptation uses `wd = 0` in the trust ratio as
    well (TF Model Garden uses `||g + wd * w||` as the denominator instead of
    `||g|| + wd * ||w||`; the two agree when `wd = 0`).

    `weight_decay` is the L2 coefficient inside the update above; the Keras
    base class's decoupled decay is not applied on top of it.

    Example:

    ```python
    schedule = tfdp.WarmupSchedule(
        tfdp.scale_lr(0.1, 256, global_batch), warmup_steps=500,
        total_steps=10_000, decay="poly", power=2.0)
    model.compile(
        optimizer=tfdp.optimizers.LARS(schedule, weight_decay=1e-4),
        loss="sparse_categorical_crossentropy")
    ```

    Args:
        learning_rate: a float, a
            `keras.optimizers.schedules.LearningRateSchedule` (called with the
            optimizer step, e.g. `tfdp.WarmupSchedule`), or a callable with no
            arguments returning the learning rate.
        momentum: momentum coefficient in `[0, 1)`; 0 keeps no momentum
            slot. Defaults to `0.9`.
        weight_decay: L2 weight-decay coefficient `>= 0`. Defaults to `0.0`.
        eeta: LARS trust coefficient `> 0`. Defaults to `0.001`.
        epsilon: `>= 0`, added to the trust-ratio denominator. Defaults to
            `0.0`.
        nesterov: whether to use Nesterov momentum. Defaults to `False`.
        exclude_from_weight_decay: regular expressions searched
            (`re.search`) in each variable's `path`; matching variables get
            no weight decay. `None` (default) excludes biases and
            normalisation `gamma`/`beta`
            (`tfdp.optimizers.DEFAULT_EXCLUDE_PATTERNS`); `[]` excludes
            nothing.
        exclude_from_layer_adaptation: the same for the trust ratio
            (matching variables use trust 1). `None` (default) uses the
            `exclude_from_weight_decay` patterns.
        name: the optimizer's name, the prefix of its variables' paths.
            Defaults to a unique name Keras derives from the class name.
        **kwargs: the other `keras.optimizers.Optimizer` arguments:
            `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`,
            `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`.

    Raises:
        TypeError: an argument has the wrong type (e.g. a single string for
            an exclusion list, or a non-bool `nesterov`).
        ValueError: an argument is out of range or a pattern does not
            compile.

    References:
        - [You et al., 2017](https://arxiv.org/abs/1708.03888)
    """

    def __init__(
        self,
        learning_rate,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eeta: float = 0.001,
        epsilon: float = 0.0,
        nesterov: bool = False,
        exclude_from_weight_decay: Sequence[str] | None = None,
        exclude_from_layer_adaptation: Sequence[str] | None = None,
        name: str | None = None,
        **kwargs,
    ):
        momentum = _checks.check_float(
            "momentum", momentum, minimum=0.0, maximum=1.0, include_maximum=False
        )
        weight_decay = _checks.check_float("weight_decay", weight_decay, minimum=0.0)
        eeta = _checks.check_float("eeta", eeta, minimum=0.0, include_minimum=False)
        epsilon = _checks.check_float("epsilon", epsilon, minimum=0.0)
        nesterov = _checks.check_bool("nesterov", nesterov)
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            name=name,
            **kwargs,
        )
        self.momentum = momentum
        self.eeta = eeta
        self.epsilon = epsilon
        self.nesterov = nesterov
        self._setup_exclusions(exclude_from_weight_decay, exclude_from_layer_adaptation)

    def build(self, variables):
        """Creates one momentum slot per variable (none when `momentum == 0`)."""
        if self.built:
            return
        super().build(variables)
        self._momentums = []
        if self.momentum != 0:
            self._momentums = self.add_optimizer_variables(variables, "momentum")

    def update_step(self, gradient, variable, learning_rate):
        """Applies one LARS step to `variable`; see the class docstring."""
        index = keras_optimizer_internals.variable_index(self, variable)
        dtype = variable.dtype
        if isinstance(gradient, tf.IndexedSlices):
            # The norms need the whole gradient; duplicate indices are summed.
            gradient = tf.convert_to_tensor(gradient)
        gradient = ops.cast(gradient, dtype)
        learning_rate = ops.cast(learning_rate, dtype)
        weight_decay = self.weight_decay if self._decays[index] else 0.0

        direction = gradient
        if weight_decay:
            direction = gradient + ops.cast(weight_decay, dtype) * variable

        scaled_lr = learning_rate
        if self._adapts[index]:
            w_squares, g_squares = self._whole_sums_of_squares(index, variable, gradient)
            w_norm = ops.sqrt(w_squares)
            g_norm = ops.sqrt(g_squares)
            denominator = g_norm + ops.cast(weight_decay, dtype) * w_norm
            denominator = denominator + ops.cast(self.epsilon, dtype)
            both_positive = ops.logical_and(w_norm > 0, g_norm > 0)
            safe_denominator = ops.where(both_positive, denominator, 1.0)
            trust = ops.where(
                both_positive,
                ops.cast(self.eeta, dtype) * w_norm / safe_denominator,
                1.0,
            )
            scaled_lr = learning_rate * trust

        step = scaled_lr * direction
        if self.momentum == 0:
            self.assign_sub(variable, step)
            return
        momentum = ops.cast(self.momentum, dtype)
        velocity = self._momentums[index]
        self.assign(velocity, momentum * velocity + step)
        if self.nesterov:
            self.assign_sub(variable, momentum * velocity + step)
        else:
            self.assign_sub(variable, velocity)

    def norm_terms(self, gradient, variable):
        """float32 `[sum(w**2), sum(g**2)]` over `variable` (see the mixin)."""
        gradient = ops.cast(tf.convert_to_tensor(gradient), variable.dtype)
        return tf.cast(tf.stack([ops.sum(ops.square(variable)), ops.sum(ops.square(gradient))]),
                       tf.float32)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "eeta": self.eeta,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
                **self._exclusion_config(),
            }
        )
        return config
