"""Pins tfdp._upstream.numpy_aliased_inputs to what TensorFlow does to a caller's arrays.

TensorFlow alone, no Keras: a `from_generator` dataset yields slices of one
64-byte-aligned NumPy array (aligned, so TensorFlow converts them without a
copy), a `MirroredStrategy` splits each batch over its replicas, and the
replica step computes `t * 2.0`. Under two replicas TensorFlow writes the
product into the array; `own_inputs` keeps it unchanged. The canary fails
when TensorFlow stops overwriting: then the copy can go.
"""

import numpy as np
import pytest
import tensorflow as tf

from aligned_arrays import aligned_ones
from tfdp._upstream import numpy_aliased_inputs

ROWS, FEATURES, BATCH = 32, 4, 8


def _run(devices, prepare):
    """Steps over slices of one aligned array; returns the array afterwards."""
    strategy = tf.distribute.MirroredStrategy(devices)
    array = aligned_ones((ROWS, FEATURES))
    dataset = tf.data.Dataset.from_generator(
        lambda: (array[i:i + BATCH] for i in range(0, ROWS, BATCH)),
        output_signature=tf.TensorSpec([None, FEATURES], tf.float32))
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def step(iterator):
        def replica_step(batch):
            return tf.reduce_sum(prepare(batch) * 2.0)
        return strategy.run(replica_step, args=(next(iterator),))

    for _ in range(ROWS // BATCH):
        step(iterator)
    return array


TWO_CPUS = ["/cpu:0", "/cpu:1"]


def test_canary_tensorflow_writes_a_replica_step_result_into_the_callers_array():
    array = _run(TWO_CPUS, lambda batch: batch)
    assert not np.all(array == 1.0), (
        f"TensorFlow {tf.__version__} no longer writes into a generator's NumPy arrays under "
        "two replicas: tfdp/_upstream/numpy_aliased_inputs.py and its calls in "
        "tfdp/training/train_step.py can go (or be gated to older versions).")
    assert set(np.unique(array)) <= {1.0, 2.0}  # the product, written in place


def test_own_inputs_leaves_the_callers_array_as_it_was():
    array = _run(TWO_CPUS, numpy_aliased_inputs.own_inputs)
    np.testing.assert_array_equal(array, 1.0)


def test_one_replica_reads_whole_batches_and_tensorflow_leaves_them():
    # Why `needed()` is False for one replica.
    array = _run(["/cpu:0"], lambda batch: batch)
    np.testing.assert_array_equal(array, 1.0)


def test_needed_only_with_two_or_more_replicas_in_sync():
    for devices, expected in ((["/cpu:0"], False), (TWO_CPUS, True)):
        strategy = tf.distribute.MirroredStrategy(devices)
        seen = strategy.run(lambda: tf.constant(numpy_aliased_inputs.needed()))
        assert all(bool(v) is expected for v in strategy.experimental_local_results(seen))
    assert numpy_aliased_inputs.needed() is False  # no strategy: the default replica context


def test_only_host_devices_need_the_copy():
    assert numpy_aliased_inputs.on_host_only(["/job:worker/replica:0/task:1/device:CPU:0",
                                              "/cpu:1"])
    assert not numpy_aliased_inputs.on_host_only(["/job:localhost/replica:0/task:0/device:GPU:0"])
    assert not numpy_aliased_inputs.on_host_only(["/device:CPU:0", "/device:TPU:0"])


@pytest.mark.parametrize("value", [None, np.ones(2, np.float32), "text"])
def test_own_inputs_passes_what_is_not_a_tensor_through(value):
    assert numpy_aliased_inputs.own_inputs({"v": value})["v"] is value


def test_own_inputs_copies_a_tensor_into_new_memory_with_the_same_value():
    tensor = tf.constant([[1.0, 2.0]])
    copied = numpy_aliased_inputs.own_inputs((tensor,))[0]
    np.testing.assert_array_equal(copied.numpy(), tensor.numpy())
    ragged = tf.ragged.constant([[1], [2, 3]])
    assert numpy_aliased_inputs.own_inputs(ragged) is ragged  # composite: left as it is
