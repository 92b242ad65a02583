"""Private `tf.distribute` state that tfdp reads or works around.

This module owns every touch of a private attribute of a `tf.distribute`
strategy (TensorFlow 2.21):

- `all_reduce_name` answers "which all-reduce is this strategy really
  using?", which TensorFlow has no public API for. Read-only.
- `reserve_collective_keys` works around collective-key collisions between
  MirroredStrategy instances in one process (tensorflow/tensorflow#61314,
  #62790): every instance starts its collective group keys at 1, so a second
  strategy over a different device set joins the first one's group and fails
  with "Device ... is joining a group with size 4, but that group has size 2".
  TensorFlow's own tests bump the class's key base for each strategy
  (`tensorflow/python/distribute/strategy_combinations.py`); so do we.
- `parameter_server_cluster` reads a `ParameterServerStrategy`'s cluster:
  its public `cluster_resolver` property is None in TensorFlow 2.21 (the
  base `Strategy.cluster_resolver` reads `extended._cluster_resolver`, which
  `ParameterServerStrategyV2Extended` never sets; the strategy keeps the
  resolver in its own `_cluster_resolver`). Read-only.

`tests/_upstream/test_strategy_internals.py` fails when these attributes move
or the collision no longer happens, which tells us to update this one file.
"""

from __future__ import annotations

import tensorflow as tf


# Group keys one MirroredStrategy may use before the next one's range starts;
# the value TensorFlow's strategy_combinations.py uses.
_COLLECTIVE_KEY_STRIDE = 100_000


def reserve_collective_keys() -> int:
    """Gives the next MirroredStrategy built in this process its own key range.

    Call right before constructing a `tf.distribute.MirroredStrategy`.

    Returns:
        The collective group key base the next strategy will use.
    """
    # pylint: disable=protected-access
    tf.distribute.MirroredStrategy._collective_key_base += _COLLECTIVE_KEY_STRIDE
    return tf.distribute.MirroredStrategy._collective_key_base


def _collective_implementation(options, devices) -> str:
    """Names the collective implementation that `options` resolves to.

    `CommunicationImplementation.AUTO` lets the runtime pick: NCCL when every
    device is a GPU and ring otherwise (CPU collectives are always ring).
    """
    implementation = options.implementation.name.lower()
    if implementation == "auto":
        on_gpus = devices and all("GPU" in d.upper() for d in devices)
        return "nccl" if on_gpus else "ring"
    return implementation


def all_reduce_name(strategy: tf.distribute.Strategy) -> str:
    """The all-reduce implementation `strategy` uses for gradients.

    Args:
        strategy: any `tf.distribute.Strategy`.

    Returns:
        One of `"none"` (a single replica: nothing to reduce),
        `"nccl"`, `"hierarchical_copy"`, `"reduce_to_one"` (MirroredStrategy's
        cross-device ops), or `"collective/ring"`, `"collective/nccl"`
        (collective ops, MirroredStrategy's TF default or
        MultiWorkerMirroredStrategy), with `"/packs=N"` appended where a pack
        count other than one is in use.
    """
    if strategy.num_replicas_in_sync == 1 and not isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ):
        return "none"
    extended = strategy.extended
    devices = tuple(extended.worker_devices)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        options = extended._communication_options  # pylint: disable=protected-access
        name = "collective/" + _collective_implementation(options, devices)
        if options.bytes_per_pack:
            name += f"/bytes_per_pack={options.bytes_per_pack}"
        return name
    ops = getattr(extended, "_cross_device_ops", None)
    if isinstance(ops, tf.distribute.NcclAllReduce):
        name = "nccl"
    elif isinstance(ops, tf.distribute.HierarchicalCopyAllReduce):
        name = "hierarchical_copy"
    elif isinstance(ops, tf.distribute.ReductionToOneDevice):
        return "reduce_to_one"
    elif ops is not None and type(ops).__name__ == "CollectiveAllReduce":
        return "collective/" + _collective_implementation(
            ops._options, devices  # pylint: disable=protected-access
        )
    else:
        return type(ops).__name__
    num_packs = getattr(ops, "_num_packs", 1)
    return name if num_packs == 1 else f"{name}/packs={num_packs}"


def parameter_server_cluster(strategy: tf.distribute.Strategy) -> tf.train.ClusterSpec:
    """The cluster a `tf.distribute.experimental.ParameterServerStrategy` was built over.

    Raises:
        ValueError: `strategy` is not a `ParameterServerStrategy`.
    """
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            "parameter_server_cluster reads a ParameterServerStrategy. "
            f"Received: {type(strategy).__name__}")
    resolver = strategy.cluster_resolver
    if resolver is None:  # TensorFlow 2.21: see the module docstring
        resolver = strategy._cluster_resolver  # pylint: disable=protected-access
    return resolver.cluster_spec()
