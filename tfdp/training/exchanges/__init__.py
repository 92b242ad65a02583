"""The exchanges of the gradient path, one module each, behind `base.Exchange`.

- `all_reduce`: the plain or bfloat16 all-reduce SUM, with the deferred
  global divisor riding in it;
- `bucketed`: the same sum in DDP's gradient buckets, each all-reduced as
  soon as its gradients exist, during the rest of the backward pass;
- `compressed`: a `tfdp.compression` compressor (PowerSGD, Top-K) with its
  start step and error memories;
- `sharded`: ZeRO-1 around either of those (reduce-scatter, chunks, gather);
- `local_steps`: local SGD and DiLoCo (no gradient exchange; the weights
  meet every `sync_every` steps, or, overlapped, their all-reduce runs
  during the next window: `tfdp.distribute.overlapped_sync`).

`for_options` picks and composes them from the wrapper's options; which
options may be combined at all is `tfdp.training.option_rules`'s, checked
before anything is built. This package owns no verdict, counter or loss
scale: those are `tfdp.training.verdict`'s and the wrappers'.
"""

from __future__ import annotations

from tfdp.training.exchanges import all_reduce
from tfdp.training.exchanges import base
from tfdp.training.exchanges import bucketed
from tfdp.training.exchanges import compressed
from tfdp.training.exchanges import local_steps
from tfdp.training.exchanges import sharded

Exchange = base.Exchange
Step = base.Step


def for_options(optimizer, *, all_reduce_dtype=None, compressor=None, local_sync=None,
                sharding=None, bucket_cap_mb=None) -> base.Exchange:
    """The exchange for a wrapper's options (already checked together by `option_rules`).

    Args:
        optimizer: the optimizer wrapper the exchange works for.
        all_reduce_dtype: `None` or `"bfloat16"`.
        compressor: a `tfdp.distribute.compression.GradientCompressor` or `None`.
        local_sync: a `tfdp.distribute.local_sync.LocalSync` or `None`.
        sharding: a `tfdp.distribute.optimizer_sharding.OptimizerSharding` or `None`.
        bucket_cap_mb: `None`, or MiB per gradient bucket (`Bucketed`).

    Returns:
        `LocalSteps` with local steps; else `AllReduce`, `Bucketed` or
        `Compressed`, inside `Sharded` when the optimizer state is sharded.
    """
    if local_sync is not None:
        return local_steps.LocalSteps(optimizer, local_sync)
    if compressor is not None:
        exchange = compressed.Compressed(optimizer, compressor, all_reduce_dtype)
    elif bucket_cap_mb is not None:
        exchange = bucketed.Bucketed(optimizer, bucket_cap_mb, all_reduce_dtype)
    else:
        exchange = all_reduce.AllReduce(optimizer, all_reduce_dtype)
    if sharding is not None:
        exchange = sharded.Sharded(optimizer, exchange, sharding)
    return exchange
