"""The LAMB optimizer (You et al., 2019, Algorithm 2) as a Keras 3 optimizer.

This module owns the LAMB update rule. It builds on `keras.optimizers.Lamb`
(same moment slots, constructor plumbing and config keys) and replaces its
`update_step` where Keras departs from the paper; the class docstring lists
the differences. Exclusion lists live in `tfdp.training.optimizers._exclusion`.
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
class LAMB(LayerwiseExclusionMixin, keras.optimizers.Lamb):
    """Layer-wise Adaptive Moments for Batch training (LAMB).

    For each variable `w` with (replica-aggregated) gradient `g`, at optimizer
    step `t = 1, 2, ...`:

    ```
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g**2
    r = (m / (1 - beta_1**t)) / (sqrt(v / (1 - beta_2**t)) + epsilon)
    r = r + wd * w          # wd = weight_decay, or 0 if w is excluded
    trust = ||w|| / ||r||   # 1 if either norm is 0, or w is excluded
    w = w - learning_rate * trust * r
    ```

    Norms are L2 over the whole variable; under a `tf.distribute` strategy
    they are taken on the mirrored variable after the gradient all-reduce.

    Differences from `keras.optimizers.Lamb`, which this class extends:

    - Weight decay enters `r` before the trust ratio, as in the paper (and
      in TF Addons' and Model Garden's LAMB). Keras's Lamb leaves weight
      decay to the base class, which applies the decoupled
      `w -= learning_rate * weight_decay * w` before the step and outside
      the trust ratio (keras-team/keras#19981); that base decay is switched
      off here, so weights are decayed once.
    - Variables can be excluded from weight decay and from the trust ratio
      by path pattern (BERT excludes LayerNorm and biases).
    - `epsilon` defaults to `1e-6` (the paper, BERT) instead of `1e-7`.

    With `weight_decay=0`, no exclusions and the same `epsilon`, the two
    compute the same update.

    Args:
        learning_rate: a float, a
            `keras.optimizers.schedules.LearningRateSchedule` (called with the
            optimizer step, e.g. `tfdp.WarmupSchedule`), or a callable with no
            arguments returning the learning rate.
        beta_1: decay of the first-moment estimate, in `[0, 1)`. Defaults to
            `0.9`.
        beta_2: decay of the second-moment estimate, in `[0, 1)`. Defaults
            to `0.999`.
        epsilon: `> 0`, added to `sqrt(v_hat)`. Defaults to `1e-6`.
        weight_decay: weight-decay coefficient `>= 0`, added to `r` as
            above. Defaults to `0.0`.
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
            an exclusion list).
        ValueError: an argument is out of range or a pattern does not
            compile.

    References:
        - [You et al., 2019](https://arxiv.org/abs/1904.00962)
    """

    def __init__(
        self,
        learning_rate,
        *,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        exclude_from_weight_decay: Sequence[str] | None = None,
        exclude_from_layer_adaptation: Sequence[str] | None = None,
        name: str | None = None,
        **kwargs,
    ):
        beta_1 = _checks.check_float(
            "beta_1", beta_1, minimum=0.0, maximum=1.0, include_maximum=False
        )
        beta_2 = _checks.check_float(
            "beta_2", beta_2, minimum=0.0, maximum=1.0, include_maximum=False
        )
        epsilon = _checks.check_float(
            "epsilon", epsilon, minimum=0.0, include_minimum=False
        )
        weight_decay = _checks.check_float("weight_decay", weight_decay, minimum=0.0)
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            weight_decay=weight_decay,
            name=name,
            **kwargs,
        )
        self._setup_exclusions(exclude_from_weight_decay, exclude_from_layer_adaptation)

    def _moments_and_direction(self, gradient, variable, index):
        """`(new m, new v, r)` for one step of `variable`, without assigning anything."""
        dtype = variable.dtype
        if isinstance(gradient, tf.IndexedSlices):
            # The moments and norms need the whole gradient.
            gradient = tf.convert_to_tensor(gradient)
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        beta_1 = ops.cast(self.beta_1, dtype)
        beta_2 = ops.cast(self.beta_2, dtype)
        m, v = keras_optimizer_internals.lamb_moments(self, index)
        # 1 - beta in float64 before the cast: 1 - float32(0.9) is off by 2e-7.
        m = m + (gradient - m) * ops.cast(1.0 - self.beta_1, dtype)
        v = v + (ops.square(gradient) - v) * ops.cast(1.0 - self.beta_2, dtype)
        m_hat = m / (1.0 - ops.power(beta_1, step))
        v_hat = v / (1.0 - ops.power(beta_2, step))
        update = m_hat / (ops.sqrt(v_hat) + ops.cast(self.epsilon, dtype))
        if self._decays[index] and self.weight_decay:
            update = update + ops.cast(self.weight_decay, dtype) * variable
        return m, v, update

    def update_step(self, gradient, variable, learning_rate):
        """Applies one LAMB step to `variable`; see the class docstring."""
        index = keras_optimizer_internals.variable_index(self, variable)
        learning_rate = ops.cast(learning_rate, variable.dtype)
        new_m, new_v, update = self._moments_and_direction(gradient, variable, index)
        m, v = keras_optimizer_internals.lamb_moments(self, index)
        self.assign(m, new_m)
        self.assign(v, new_v)
        if self._adapts[index]:
            w_squares, r_squares = self._whole_sums_of_squares(index, variable, update)
            w_norm = ops.sqrt(w_squares)
            r_norm = ops.sqrt(r_squares)
            both_positive = ops.logical_and(w_norm > 0, r_norm > 0)
            trust = ops.where(
                both_positive, w_norm / ops.where(both_positive, r_norm, 1.0), 1.0
            )
            update = trust * update
        self.assign_sub(variable, learning_rate * update)

    def norm_terms(self, gradient, variable):
        """float32 `[sum(w**2), sum(r**2)]` over `variable`, `r` this step's direction (see the mixin)."""
        index = keras_optimizer_internals.variable_index(self, variable)
        _, _, update = self._moments_and_direction(gradient, variable, index)
        return tf.cast(tf.stack([ops.sum(ops.square(variable)), ops.sum(ops.square(update))]),
                       tf.float32)

    def get_config(self):
        config = super().get_config()
        config.update(self._exclusion_config())
        return config
