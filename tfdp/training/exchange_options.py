"""The options both optimizer wrappers take beside their inner optimizer: checked, built, saved.

`tfdp.training.guard_optimizer.NonFiniteGuard` and
`tfdp.training.loss_scaling.NonFiniteLossScaleOptimizer` take the same
exchange options (`max_consecutive_nonfinite`, `all_reduce_dtype`,
`compressor`, `local_sync`, `shard_optimizer_state`, `bucket_cap_mb`), each as an object or,
from a `.keras` file, its config. This module owns turning those arguments
into checked objects (`ExchangeOptions.checked`: each alone, then every pair
through `tfdp.training.option_rules`), building ZeRO-1's sharding from the
inner optimizer (`sharding_of`) and writing them back into a config
(`config_of`). `tfdp.training.optimizer_step.OptimizerStep._adopt` takes
them; the step itself lives there.
"""

from __future__ import annotations

import dataclasses

from tfdp.distribute import compression
from tfdp.distribute import compressor_config
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.distribute import optimizer_sharding
from tfdp.distribute import shard_layout
from tfdp.training import verdict as verdict_lib


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
    """The options both optimizer wrappers take beside their inner optimizer, checked.

    `tfdp.training.nonfinite.NonFiniteGuard` and
    `tfdp.training.loss_scaling.NonFiniteLossScaleOptimizer` build one with
    `checked` before Keras' `__init__` (a refused option builds nothing) and
    hand it to `tfdp.training.optimizer_step.OptimizerStep._adopt` after.

    Attributes:
        max_consecutive_nonfinite: skipped steps in a row before stopping.
        all_reduce_dtype: `None` or `"bfloat16"`.
        compressor: a `GradientCompressor`, or None.
        local_sync: a `LocalSync`, or None.
        shard_optimizer_state: ZeRO-1.
        bucket_cap_mb: `None`, or MiB per gradient bucket all-reduced during
            the backward pass (`tfdp.training.exchanges.bucketed`).
    """

    max_consecutive_nonfinite: int
    all_reduce_dtype: str | None
    compressor: compression.GradientCompressor | None
    local_sync: local_sync_lib.LocalSync | None
    shard_optimizer_state: bool
    bucket_cap_mb: float | None = None

    @classmethod
    def checked(cls, max_consecutive_nonfinite, all_reduce_dtype, compressor, local_sync,
                shard_optimizer_state, bucket_cap_mb=None) -> "ExchangeOptions":
        """From a wrapper's arguments (objects or their configs): each alone, then every pair.

        Raises:
            ValueError: one is invalid, or `tfdp.training.option_rules` refuses a pair.
        """
        compressor = compressor_of(compressor)
        local_sync = local_sync_of(local_sync)
        verdict_lib.check_arguments("skip", max_consecutive_nonfinite, all_reduce_dtype,
                                    compressor, local_sync, shard_optimizer_state,
                                    bucket_cap_mb=bucket_cap_mb)
        return cls(int(max_consecutive_nonfinite), all_reduce_dtype, compressor, local_sync,
                   shard_optimizer_state, bucket_cap_mb)


def compressor_of(compressor):
    """The compressor of a wrapper's `compressor` argument (an object, its config, or None)."""
    if isinstance(compressor, dict):
        return compressor_config.deserialize(compressor)
    return compressor


def local_sync_of(local_sync):
    """The `LocalSync` of a wrapper's `local_sync` argument (an object, its config, or None)."""
    if isinstance(local_sync, dict):
        return local_sync_lib.LocalSync.from_config(local_sync)
    if local_sync is not None and not isinstance(local_sync, local_sync_lib.LocalSync):
        raise ValueError(
            "`local_sync` must be a tfdp.distribute.local_sync.LocalSync or None. "
            f"Received: local_sync={local_sync!r}"
        )
    return local_sync


def sharding_of(shard_optimizer_state: bool, inner_optimizer):
    """The `OptimizerSharding` for `shard_optimizer_state=True` (checks the inner optimizer), else None."""
    if not shard_optimizer_state:
        return None
    shard_layout.check_optimizer(inner_optimizer)
    return optimizer_sharding.OptimizerSharding()


def config_of(optimizer) -> dict:
    """The exchange options of `optimizer`'s config (JSON-able); `optimizer` is an `OptimizerStep`."""
    return {
        "max_consecutive_nonfinite": optimizer.max_consecutive_nonfinite,
        "all_reduce_dtype": optimizer.all_reduce_dtype,
        "compressor": compressor_config.serialize(optimizer.compressor),
        "local_sync": None if optimizer.local_sync is None else optimizer.local_sync.get_config(),
        "shard_optimizer_state": optimizer.sharding is not None,
        "bucket_cap_mb": optimizer.bucket_cap_mb,
    }
