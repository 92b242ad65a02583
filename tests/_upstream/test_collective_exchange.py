"""Pins the private collective launcher members `tfdp/_upstream/collective_exchange.py` reads.

When one of these fails after a TensorFlow upgrade, update that module (and
only that one); ZeRO-1 is refused meanwhile, with an error that says why.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp._upstream import collective_exchange


@pytest.fixture(scope="module")
def strategies():
    return {n: tfdp.make_strategy(cpu_replicas=n) for n in (2, 3)}


def test_installed_tensorflow_is_in_the_known_range():
    assert collective_exchange.is_supported(), (
        f"TensorFlow {tf.__version__} is outside KNOWN_TF_RANGE "
        f"{collective_exchange.KNOWN_TF_RANGE}: check the launcher members and widen it.")
    assert not collective_exchange.is_supported("2.99.0")
    assert not collective_exchange.is_supported("2.15.1")


@pytest.mark.parametrize("replicas", [2, 3])
def test_rows_go_to_the_replica_of_their_index(strategies, replicas):
    strategy = strategies[replicas]
    assert collective_exchange.available(strategy)

    @tf.function
    def exchange():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            me = tf.cast(context.replica_id_in_sync_group, tf.float32)
            # Row j: 10 * sender + j, twice; goes to replica j.
            rows = 10.0 * me + tf.range(replicas, dtype=tf.float32)
            sent = tf.stack([rows, rows], axis=1)
            # Two in a row: each gets its own instance key, in order.
            first = collective_exchange.all_to_all(context, sent)
            second = collective_exchange.all_to_all(context, first + 100.0)
            return first, second

        first, second = strategy.run(replica_fn)
        return (strategy.experimental_local_results(first),
                strategy.experimental_local_results(second))

    firsts, seconds = exchange()
    assert len(firsts) == replicas
    for receiver, (first, second) in enumerate(zip(firsts, seconds)):
        expected = np.array([[10.0 * sender + receiver] * 2 for sender in range(replicas)])
        np.testing.assert_array_equal(first.numpy(), expected)
        # The second exchange sends row j of `first` (what j sent) back to j.
        expected_second = np.array([[10.0 * receiver + sender + 100.0] * 2
                                    for sender in range(replicas)])
        np.testing.assert_array_equal(second.numpy(), expected_second)


def test_strategies_without_collective_launchers_are_not_available():
    assert not collective_exchange.available(tf.distribute.get_strategy())
    one = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert not collective_exchange.available(one)


def test_reduce_scatter_sums_each_replicas_row_over_the_replicas(strategies):
    strategy = strategies[3]
    assert collective_exchange.exchange_kind(strategy) == "all_to_all"

    @tf.function
    def exchange():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            me = tf.cast(context.replica_id_in_sync_group, tf.float32)
            # Row j, column c: 100 * sender + 10 * j + c.
            rows = (100.0 * me + 10.0 * tf.range(3, dtype=tf.float32)[:, None]
                    + tf.range(2, dtype=tf.float32)[None, :])
            return collective_exchange.reduce_scatter_sum(context, rows)

        return strategy.experimental_local_results(strategy.run(replica_fn))

    for receiver, chunk in enumerate(exchange()):
        expected = [sum(100.0 * sender + 10.0 * receiver + c for sender in range(3))
                    for c in range(2)]
        np.testing.assert_array_equal(chunk.numpy(), expected)


@pytest.mark.parametrize("devices, kind", [
    (["/job:worker/replica:0/task:0/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"],
     "reduce_scatter"),
    (["/device:GPU:0", "/device:GPU:1"], "reduce_scatter"),
    (["/device:CPU:0", "/device:CPU:1"], "all_to_all"),
    (["/device:GPU:0", "/device:CPU:0"], "all_to_all"),
    ([], "all_to_all"),
])
def test_nccl_reduce_scatter_is_chosen_only_when_every_replica_is_on_a_gpu(devices, kind):
    # NCCL's CollectiveReduceScatterV2 has no CPU implementation, so only the
    # choice is tested here; the op itself has not run (no GPU).
    assert collective_exchange.kind_for_devices(devices) == kind
