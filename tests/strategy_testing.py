"""Test helpers for strategies: a MirroredStrategy that counts its all-reduces."""

import tensorflow as tf


class _CountingReduction(tf.distribute.ReductionToOneDevice):
    """ReductionToOneDevice that counts, at run time, the all-reduces it performs."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    # The public entry points: one call is one all-reduce launched by the
    # strategy (ReductionToOneDevice's batch implementation reduces value by
    # value internally; those are not separate launches).
    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        with tf.control_dependencies([self.counter.assign_add(1)]):
            return super().batch_reduce(reduce_op, value_destination_pairs, options)

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        with tf.control_dependencies([self.counter.assign_add(1)]):
            return super().reduce(reduce_op, per_replica_value, destinations, options)


def counting_mirrored_strategy():
    """A MirroredStrategy over two CPUs and a counter of the all-reduces it runs.

    Returns:
        `(strategy, counter)`; the counter is an int64 `tf.Variable` that
        grows by one each time an all-reduce runs (at run time, not when it
        is traced). Used by the accumulation, non-finite, reduction and Trainer tests.
    """
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    from tfdp._upstream import strategy_internals

    strategy_internals.reserve_collective_keys()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], _CountingReduction(counter))
    return strategy, counter
