"""Pins the private collective launcher members `tfdp/_upstream/collective_all_to_all.py` reads.

When one of these fails after a TensorFlow upgrade, update that module (and
only that one); ZeRO-1 falls back to all-reduce and slice meanwhile.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp._upstream import collective_all_to_all


@pytest.fixture(scope="module")
def strategies():
    return {n: tfdp.make_strategy(cpu_replicas=n) for n in (2, 3)}


def test_installed_tensorflow_is_in_the_known_range():
    assert collective_all_to_all.is_supported(), (
        f"TensorFlow {tf.__version__} is outside KNOWN_TF_RANGE "
        f"{collective_all_to_all.KNOWN_TF_RANGE}: check the launcher members and widen it.")
    assert not collective_all_to_all.is_supported("2.99.0")
    assert not collective_all_to_all.is_supported("2.15.1")


@pytest.mark.parametrize("replicas", [2, 3])
def test_rows_go_to_the_replica_of_their_index(strategies, replicas):
    strategy = strategies[replicas]
    assert collective_all_to_all.available(strategy)

    @tf.function
    def exchange():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            me = tf.cast(context.replica_id_in_sync_group, tf.float32)
            # Row j: 10 * sender + j, twice; goes to replica j.
            rows = 10.0 * me + tf.range(replicas, dtype=tf.float32)
            sent = tf.stack([rows, rows], axis=1)
            # Two in a row: each gets its own instance key, in order.
            first = collective_all_to_all.all_to_all(context, sent)
            second = collective_all_to_all.all_to_all(context, first + 100.0)
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
    assert not collective_all_to_all.available(tf.distribute.get_strategy())
    one = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert not collective_all_to_all.available(one)
