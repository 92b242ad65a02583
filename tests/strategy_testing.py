"""Test helpers for strategies: MirroredStrategies that count their collectives."""

import numpy as np
import tensorflow as tf

from tfdp.training import metric_reads


def _counted(count_metric_reads: bool) -> bool:
    """Whether the collective being built counts: the metrics reads of `fit`
    and `evaluate` (`tfdp.training.metric_reads`, one per read) only when asked."""
    return count_metric_reads or metric_reads.NAME_SCOPE not in tf.get_current_name_scope()


class _CountingReduction(tf.distribute.ReductionToOneDevice):
    """ReductionToOneDevice that counts, at run time, the all-reduces it performs."""

    def __init__(self, counter, count_metric_reads=False):
        super().__init__()
        self.counter = counter
        self.count_metric_reads = count_metric_reads

    # The public entry points: one call is one all-reduce launched by the
    # strategy (ReductionToOneDevice's batch implementation reduces value by
    # value internally; those are not separate launches).
    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        if not _counted(self.count_metric_reads):
            return super().batch_reduce(reduce_op, value_destination_pairs, options)
        with tf.control_dependencies([self.counter.assign_add(1)]):
            return super().batch_reduce(reduce_op, value_destination_pairs, options)

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        if not _counted(self.count_metric_reads):
            return super().reduce(reduce_op, per_replica_value, destinations, options)
        with tf.control_dependencies([self.counter.assign_add(1)]):
            return super().reduce(reduce_op, per_replica_value, destinations, options)


def counting_mirrored_strategy():
    """A MirroredStrategy over two CPUs and a counter of the all-reduces it runs.

    The metrics reads of `fit` and `evaluate` are not counted.

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


class _MeasuringReduction(tf.distribute.ReductionToOneDevice):
    """Counts collectives and the values each replica contributes, at run time."""

    def __init__(self, calls, values, gathers, count_metric_reads=False):
        super().__init__()
        self.calls, self.values, self.gathers = calls, values, gathers
        self.count_metric_reads = count_metric_reads
        #: The dtype of every counted tensor, appended when it is traced.
        self.dtypes: list[str] = []

    def _count(self, per_replica_values):
        self.dtypes.extend(v.values[0].dtype.name for v in per_replica_values)
        size = sum(int(np.prod(v.values[0].shape)) for v in per_replica_values)
        return [self.values.assign_add(size)]

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        if not _counted(self.count_metric_reads):
            return super().batch_reduce(reduce_op, value_destination_pairs, options)
        counted = self._count([v for v, _ in value_destination_pairs])
        with tf.control_dependencies(counted + [self.calls.assign_add(1)]):
            return super().batch_reduce(reduce_op, value_destination_pairs, options)

    def _gather(self, per_replica_value, destinations, axis, options=None):
        counted = self._count([per_replica_value])
        with tf.control_dependencies(counted + [self.gathers.assign_add(1)]):
            return super()._gather(per_replica_value, destinations, axis, options)


def measuring_strategy(replicas: int = 2, *, count_metric_reads: bool = False):
    """A MirroredStrategy over `replicas` CPUs that measures its collectives.

    The metrics reads of `fit` and `evaluate` are left out unless
    `count_metric_reads`.

    Returns:
        `(strategy, (all_reduces, values, all_gathers))`: int64 variables
        that grow at run time by one per batched all-reduce, by the values
        each replica contributes, and by one per all-gather. The dtype
        names of the tensors on the wire are in `strategy.wire_dtypes`
        (recorded when traced).
    """
    counters = [tf.Variable(0, dtype=tf.int64, trainable=False) for _ in range(3)]
    from tfdp._upstream import strategy_internals

    strategy_internals.reserve_collective_keys()
    measuring = _MeasuringReduction(*counters, count_metric_reads=count_metric_reads)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)], measuring)
    strategy.wire_dtypes = measuring.dtypes
    return strategy, counters
