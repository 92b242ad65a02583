"""Reduce-scatter and all-to-all among a strategy's replicas, through its own collective launchers.

`tf.distribute` offers all-reduce and all-gather in a replica context, but
no reduce-scatter and no all-to-all. ZeRO-1
(`tfdp.distribute.optimizer_sharding`) needs the reduce-scatter: each
replica wants only its own chunk of the summed gradients. TensorFlow's
`CollectiveReduceScatterV2` has no CPU implementation ("CollectiveRegistry::
Lookup did not find collective implementation", TF 2.21), but its
`CollectiveAllToAllV2` has one: replica r sends row j of a `[N, ...]` tensor
to replica j, and summing what it receives over the rows is the
reduce-scatter, with the bytes of a ring reduce-scatter ((N - 1) / N of the
tensor per replica).

On GPUs, where NCCL implements `CollectiveReduceScatterV2`,
`reduce_scatter_sum` uses it instead (`exchange_kind` says which). That
path has not run here: the machines tfdp is tested on have no GPU, and the
op has no CPU implementation to test it with. Its selection is tested; the
all-to-all is the fallback everywhere else.

To be ordered with the strategy's other collectives (and to get instance
keys every worker agrees on), the all-to-all goes through the strategy's
`CollectiveAllReduce` launcher of the replica's device: its group, its next
instance key and its ordering token. Those are private members of
`tensorflow/python/distribute/cross_device_utils.py`
(`CollectiveReplicaLauncher`) and `cross_device_ops.py`
(`CollectiveAllReduce._launchers`); this module is the only place that
reads them. `launcher_of` answers None (and ZeRO-1 is refused:
`tfdp.distribute.shard_layout.check_strategy`) when the strategy has no
collective launchers (a single device, devices of two kinds) or TensorFlow
is outside `KNOWN_TF_RANGE`. MirroredStrategy builds them beside whatever
all-reduce it was given (`NcclAllReduce` included). `tests/_upstream/test_collective_exchange.py` is the
canary.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import device_util
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import gen_collective_ops

from tfdp._upstream import _versions

# pylint: disable=protected-access

#: TensorFlow (major, minor) versions these members were read from, inclusive.
KNOWN_TF_RANGE = ((2, 16), (2, 21))

_LAUNCHER_MEMBERS = ("_device", "_group_key", "_group_size", "_options",
                     "_next_instance_key", "_get_ordering_token")


def is_supported(tf_version: str | None = None) -> bool:
    """Whether `tf_version` (default: the installed one) is in `KNOWN_TF_RANGE`."""
    version = _versions.major_minor(tf.__version__ if tf_version is None else tf_version)
    low, high = KNOWN_TF_RANGE
    return low <= version <= high


def _launchers(strategy: tf.distribute.Strategy) -> list | None:
    """The strategy's collective launchers, one per local replica, or None when there are none to use."""
    if not is_supported() or strategy.num_replicas_in_sync < 2:
        return None
    extended = strategy.extended
    for name in ("_collective_ops", "_cross_device_ops"):  # Mirrored, MultiWorkerMirrored
        ops = getattr(extended, name, None)
        if type(ops).__name__ == "CollectiveAllReduce" and hasattr(ops, "_launchers"):
            launchers = list(ops._launchers)
            if all(hasattr(launcher, m) for launcher in launchers for m in _LAUNCHER_MEMBERS):
                return launchers
            return None
    return None


def launcher_of(strategy: tf.distribute.Strategy, device: str):
    """The collective launcher of the replica on `device`, or None when there is none to use."""
    wanted = device_util.canonicalize(device)
    for launcher in _launchers(strategy) or ():
        if device_util.canonicalize(launcher._device) == wanted:
            return launcher
    return None


def available(strategy: tf.distribute.Strategy) -> bool:
    """Whether `all_to_all` can run under `strategy` (collective launchers for every replica)."""
    return _launchers(strategy) is not None


def _timeout_seconds(launcher) -> float:
    return launcher._options.timeout_seconds or 0


def all_to_all(context: tf.distribute.ReplicaContext, tensor: tf.Tensor) -> tf.Tensor:
    """Exchanges the rows of `tensor` among the replicas (replica context).

    Args:
        context: the current replica context.
        tensor: `[N, ...]` for N replicas in sync, the same shape and dtype on
            every replica; row j goes to the replica with
            `replica_id_in_sync_group` j.

    Returns:
        `[N, ...]`: row i is what replica i sent to this replica.

    Raises:
        RuntimeError: the strategy has no collective launcher for this
            replica's device (check `available` first).
    """
    # The replica's device (ReplicaContext.devices nests it in a list under
    # MirroredStrategy; the current device is the replica's in its thread).
    device = device_util.current()
    launcher = launcher_of(context.strategy, device)
    if launcher is None:
        raise RuntimeError(
            f"No collective launcher for {device} under "
            f"{type(context.strategy).__name__}: all_to_all needs collective ops "
            f"(TensorFlow {KNOWN_TF_RANGE[0][0]}.{KNOWN_TF_RANGE[0][1]} to "
            f"{KNOWN_TF_RANGE[1][0]}.{KNOWN_TF_RANGE[1][1]}; this is {tf.__version__}). "
            "Check tfdp._upstream.collective_exchange.available() first.")
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            tensor,
            launcher._group_size,
            launcher._group_key,
            launcher._next_instance_key(),
            timeout=_timeout_seconds(launcher),
            ordering_token=launcher._get_ordering_token(),
        )


def kind_for_devices(devices) -> str:
    """`"reduce_scatter"` (NCCL's) when every device is a GPU, else `"all_to_all"`."""
    on_gpus = bool(devices) and all(
        "GPU" in device_util.canonicalize(d).upper() for d in devices)
    return "reduce_scatter" if on_gpus else "all_to_all"


def exchange_kind(strategy: tf.distribute.Strategy) -> str | None:
    """How `reduce_scatter_sum` exchanges under `strategy`; None where it cannot (`available`)."""
    launchers = _launchers(strategy)
    if launchers is None:
        return None
    return kind_for_devices([launcher._device for launcher in launchers])


def reduce_scatter_sum(context: tf.distribute.ReplicaContext, rows: tf.Tensor) -> tf.Tensor:
    """This replica's row of `rows` summed over the replicas (replica context).

    Args:
        context: the current replica context.
        rows: `[N, S]`, the same shape and dtype on every replica: row j is
            this replica's part of replica j's sum.

    Returns:
        `[S]`: the sum over the replicas of their row `replica_id_in_sync_group`.
        By all-to-all and a local sum, or by NCCL's reduce-scatter on GPUs
        (`exchange_kind`); either way each replica sends and receives
        (N - 1) / N of `rows`.
    """
    if exchange_kind(context.strategy) != "reduce_scatter":
        return tf.reduce_sum(all_to_all(context, rows), axis=0)
    launcher = launcher_of(context.strategy, device_util.current())
    with tf.device(launcher._device):
        chunk = gen_collective_ops.collective_reduce_scatter_v2(
            tf.reshape(rows, [-1]),
            group_size=launcher._group_size,
            group_key=launcher._group_key,
            instance_key=launcher._next_instance_key(),
            ordering_token=[launcher._get_ordering_token()],
            merge_op="Add",
            final_op="Id",
            communication_hint="nccl",
            timeout_seconds=_timeout_seconds(launcher),
        )
    return tf.reshape(chunk, [rows.shape[1]])
