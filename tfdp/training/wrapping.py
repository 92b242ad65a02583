"""`wrap_optimizer`: the optimizer tfdp trains with, for the options of `tfdp.compile` and `tfdp.Trainer`.

It picks the wrapper (`NonFiniteGuard`, or `NonFiniteLossScaleOptimizer`
under loss scaling) and hands it the exchange options; `guard_of` tells a
wrapper from any other optimizer. The rules for combining the options are
`tfdp.training.option_rules`'s, checked first (`verdict.check_arguments`).
"""

from __future__ import annotations

import keras

from tfdp.distribute import compression
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.training import guard_optimizer
from tfdp.training import loss_scaling as loss_scaling_lib
from tfdp.training import exchange_options
from tfdp.training import optimizer_step
from tfdp.training import verdict


def wrap_optimizer(
    optimizer,
    *,
    nonfinite: str | None,
    max_consecutive_nonfinite: int = verdict.DEFAULT_MAX_CONSECUTIVE,
    loss_scaling: bool = False,
    all_reduce_dtype: str | None = None,
    compressor: compression.GradientCompressor | None = None,
    local_sync: local_sync_lib.LocalSync | None = None,
    shard_optimizer_state: bool = False,
    bucket_cap_mb: float | None = None,
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
        bucket_cap_mb: `None`, or MiB per gradient bucket, each all-reduced
            during the backward pass (`tfdp.training.exchanges.bucketed`);
            needs a wrapper.

    Returns:
        `NonFiniteLossScaleOptimizer` under loss scaling (with `nonfinite=None`
        too: it skips overflowing steps as Keras' loss scaling does, with no
        limit), else `NonFiniteGuard` (`None` mode: `optimizer` itself).

    Raises:
        ValueError: an argument is invalid, or `all_reduce_dtype` is set with
            `nonfinite=None`.
    """
    verdict.check_arguments(nonfinite, max_consecutive_nonfinite, all_reduce_dtype, compressor,
                    local_sync, shard_optimizer_state, bucket_cap_mb=bucket_cap_mb)
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, optimizer_step.OptimizerStep):
        if all_reduce_dtype is not None:
            optimizer.all_reduce_dtype = all_reduce_dtype
        for name, value in (("gradient_compression", compressor), ("sync_every", local_sync)):
            if value is not None and optimizer.built:
                raise ValueError(f"Pass {name} before the optimizer is built.")
        if compressor is not None:
            optimizer.compressor = compressor
        if local_sync is not None:
            optimizer.local_sync = local_sync
        if bucket_cap_mb is not None:
            optimizer.bucket_cap_mb = bucket_cap_mb
        if shard_optimizer_state and optimizer.sharding is None:
            if optimizer.built:
                raise ValueError("Pass shard_optimizer_state before the optimizer is built.")
            optimizer.sharding = exchange_options.sharding_of(True, optimizer.inner_optimizer)
        verdict.check_arguments(nonfinite, max_consecutive_nonfinite, optimizer.all_reduce_dtype,
                        optimizer.compressor, optimizer.local_sync,
                        optimizer.sharding is not None, bucket_cap_mb=optimizer.bucket_cap_mb)
        return optimizer
    loss_scaling = loss_scaling or isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if nonfinite is None and not loss_scaling:
        return optimizer
    sharded = {"shard_optimizer_state": shard_optimizer_state, "bucket_cap_mb": bucket_cap_mb}
    # Under loss scaling every mode takes the one decision path here: the
    # scaled gradients are all-reduced, checked once summed (the same on every
    # replica), unscaled, and then applied or skipped (halving the scale).
    # `None` skips as Keras' loss scaling does, without a limit, and counts the
    # skips, so `iterations + skipped_steps` stays the steps taken.
    limit = {"raise": 1, None: verdict.NO_LIMIT}.get(nonfinite, max_consecutive_nonfinite)
    if not loss_scaling:
        return guard_optimizer.NonFiniteGuard(optimizer, max_consecutive_nonfinite=limit,
                              all_reduce_dtype=all_reduce_dtype, compressor=compressor,
                              local_sync=local_sync, **sharded)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return loss_scaling_lib.NonFiniteLossScaleOptimizer(
            optimizer.inner_optimizer, initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name,
            max_consecutive_nonfinite=limit, all_reduce_dtype=all_reduce_dtype,
            compressor=compressor, local_sync=local_sync, **sharded,
        )
    return loss_scaling_lib.NonFiniteLossScaleOptimizer(
        optimizer, name="loss_scale_optimizer", max_consecutive_nonfinite=limit,
        all_reduce_dtype=all_reduce_dtype, compressor=compressor, local_sync=local_sync,
        **sharded,
    )


def guard_of(optimizer) -> optimizer_step.OptimizerStep | None:
    """`optimizer` if it skips non-finite steps (a wrapper from here), else `None`."""
    return optimizer if isinstance(optimizer, optimizer_step.OptimizerStep) else None
