"""Pins the private tf.distribute attributes tfdp reads for strategy_info.

When one of these fails after a TensorFlow upgrade, update
`tfdp/_upstream/strategy_internals.py` (and only that file).
"""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tfdp
from tfdp._upstream import strategy_internals

CPUS = ["/cpu:0", "/cpu:1"]


@pytest.mark.parametrize(
    "cross_device_ops, expected",
    [
        (None, "collective/ring"),
        (tf.distribute.NcclAllReduce(), "nccl"),
        (tf.distribute.NcclAllReduce(num_packs=3), "nccl/packs=3"),
        (tf.distribute.HierarchicalCopyAllReduce(num_packs=2), "hierarchical_copy/packs=2"),
        (tf.distribute.ReductionToOneDevice(), "reduce_to_one"),
    ],
)
def test_mirrored_all_reduce_name(cross_device_ops, expected):
    strategy = tf.distribute.MirroredStrategy(CPUS, cross_device_ops=cross_device_ops)
    assert strategy_internals.all_reduce_name(strategy) == expected


def test_private_attributes_still_exist():
    mirrored = tf.distribute.MirroredStrategy(CPUS)
    assert hasattr(mirrored.extended, "_cross_device_ops")
    assert hasattr(mirrored.extended._cross_device_ops, "_options")
    assert hasattr(tf.distribute.NcclAllReduce(num_packs=2), "_num_packs")


def test_single_replica_has_no_all_reduce():
    assert strategy_internals.all_reduce_name(tf.distribute.get_strategy()) == "none"
    assert strategy_internals.all_reduce_name(tf.distribute.OneDeviceStrategy("/cpu:0")) == "none"


def _all_reduce_sum(strategy):
    """All-reduces ones([2]) inside replica context, as gradient aggregation does."""

    @tf.function
    def run():
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([2]))

        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    return run().numpy().tolist()


def test_strategies_over_different_devices_in_one_process():
    two = tfdp.make_strategy(cpu_replicas=2)
    assert _all_reduce_sum(two) == [2.0, 2.0]
    four = tfdp.make_strategy(cpu_replicas=4)
    assert _all_reduce_sum(four) == [4.0, 4.0]
    assert _all_reduce_sum(two) == [2.0, 2.0]


_COLLISION_SCRIPT = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

def all_reduce_sum(strategy):
    @tf.function
    def run():
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([2]))
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]
    return run()

all_reduce_sum(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
try:
    all_reduce_sum(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]))
    print("NO COLLISION")
except Exception as error:
    print("COLLISION", type(error).__name__)
"""


@pytest.mark.slow
def test_collective_key_collision_still_happens_upstream():
    """Fails once TensorFlow keeps strategies' collective keys apart itself.

    Then `reserve_collective_keys` can go.
    """
    result = subprocess.run(
        [sys.executable, "-c", _COLLISION_SCRIPT], capture_output=True, text=True,
        timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert "COLLISION" in result.stdout, result.stderr[-2000:]
    assert "NO COLLISION" not in result.stdout, "upstream fixed it: drop reserve_collective_keys"
