"""The non-finite guard: the verdict on a step's gradients, and the counters of skipped steps.

This module owns the guard's part of a step (`tfdp.training.optimizer_step`
runs exchange -> verdict -> apply -> finish):

- **the verdict** (`verdict`): whether the exchanged gradients are all
  finite. Computed from sums every replica received alike (or, when each
  holds only its chunks, after one all-reduce of a flag), so every replica
  and worker takes the same branch; a non-finite *loss* is folded into one
  gradient first (`fold_loss_into_gradients`), so it is caught the same way;
- **the counters** (`Counters`): `skipped_steps` and
  `consecutive_skipped_steps`, optimizer variables of the wrapper (so they
  are checkpointed with it), and the limit `max_consecutive_nonfinite` after
  which the wrapper applies nothing more ("exhausted");
- the checks of the `nonfinite` arguments.

It owns no collective of the gradients (`tfdp.training.exchanges`), no loss
scale (`tfdp.training.loss_scaling`), and not the reading of the counters
after each training call (`tfdp.training.step_monitor`).
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from tfdp import _checks
from tfdp.distribute import compression
from tfdp.distribute import reduction
from tfdp.training import option_rules
from tfdp.training.exchanges import base as exchange_base
from tfdp.training.exchanges import bucketed as exchanges_bucketed

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
                    compressor=None, local_sync=None, shard_optimizer_state=False, *,
                    bucket_cap_mb=None) -> None:
    """Validates `nonfinite`, `max_consecutive_nonfinite`, `all_reduce_dtype`, `compressor`, `local_sync`, `shard_optimizer_state`, `bucket_cap_mb`.

    Each value alone (`check_values`), then every pair of them
    (`tfdp.training.option_rules`).

    Raises:
        ValueError: one is invalid, or a pair of them is refused by
            `tfdp.training.option_rules`.
    """
    check_values(nonfinite, max_consecutive_nonfinite, all_reduce_dtype, compressor,
                 shard_optimizer_state)
    exchanges_bucketed.check_bucket_cap_mb(bucket_cap_mb)
    option_rules.check(option_rules.TrainingOptions(
        bucket_cap_mb=bucket_cap_mb,
        nonfinite=nonfinite, all_reduce_dtype=all_reduce_dtype, compressor=compressor,
        sync_every=1 if local_sync is None else local_sync.sync_every,
        outer_optimizer=None if local_sync is None else local_sync.outer_optimizer,
        overlap_sync=local_sync is not None and local_sync.overlap,
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
    _checks.check_int("max_consecutive_nonfinite", max_consecutive_nonfinite)


def _check_compressor(compressor) -> None:
    if compressor is not None and not isinstance(compressor, (compression.GradientCompressor, dict)):
        raise ValueError(
            "`compressor` must be a tfdp.compression.PowerSGD or TopK, or None. "
            f"Received: compressor={compressor!r}"
        )


def all_finite(gradients: Sequence[tf.Tensor]) -> tf.Tensor:
    """Bool scalar: every value of every gradient (tensor or `tf.IndexedSlices`) is finite."""
    checks = []
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            gradient = gradient.values
        checks.append(tf.reduce_all(tf.math.is_finite(gradient)))
    return tf.reduce_all(tf.stack(checks))


def verdict(step: exchange_base.Step) -> tf.Tensor:
    """Bool scalar, equal on every replica: the exchanged gradients of `step` are all finite.

    From whole sums (the same on every replica) no collective is needed;
    when each replica holds only its chunks (`step.partial`, ZeRO-1's
    reduce-scatter), one all-reduce of the non-finite chunk counts gives
    every replica the same verdict.
    """
    if not step.partial:
        return all_finite(step.gradients)
    flag = tf.reshape(1.0 - tf.cast(all_finite(step.gradients), tf.float32), [1])
    (nonfinite,) = reduction.all_reduce_sum(step.context, [flag])
    return nonfinite[0] == 0.0


class Counters:
    """Mixin of the optimizer wrappers: the skip counters and the limit.

    Needs `add_variable` (a Keras optimizer), `max_consecutive_nonfinite` and
    `steps_locally` (bool: each replica applies its own gradients).

    Attributes (after `_build_counters`):
        skipped_steps: int64 variable, steps skipped so far.
        consecutive_skipped_steps: int64 variable, skipped since the last
            applied step.
    """

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

    def verdict_variables(self) -> list:
        """The wrapper's own variables each replica updates from its verdicts: the counters.

        Equal on every replica when the verdict is (one all-reduced sum); under
        local steps each replica's own, so saved per replica
        (`tfdp.training.exchanges.local_steps`).
        """
        return [self.skipped_steps, self.consecutive_skipped_steps]

    def exhausted(self) -> tf.Tensor:
        """Bool scalar: `max_consecutive_nonfinite` steps in a row were skipped; apply nothing more."""
        return self.consecutive_skipped_steps >= self.max_consecutive_nonfinite

    def _count_skip(self, counts_in_a_row) -> None:
        """Counts a skipped step (unless exhausted, but always under local steps); in a row only where `counts_in_a_row`."""
        live = tf.logical_not(self.exhausted())
        # Under local steps an exhausted replica runs on, skipping, until the
        # workers agree to stop at a synchronisation (one window later when
        # overlapped): it consumes those batches, so they count, and the
        # loops' check that every step run was counted holds on it too.
        counted = tf.constant(True) if self.steps_locally else live
        self.skipped_steps.assign_add(tf.cast(counted, "int64"))
        self.consecutive_skipped_steps.assign_add(
            tf.cast(tf.logical_and(live, counts_in_a_row), "int64")
        )


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
