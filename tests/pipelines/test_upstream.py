"""Tests that the TensorFlow behaviour `pipelines` works around is still there.

Each fails when upstream changes: then delete the workaround it names.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

from pipeline_testing import get_strategy, id_dataset
from tfdp.pipelines import _upstream


def _batched(input_context):
    return id_dataset(40).batch(input_context.get_per_replica_batch_size(8))


def test_one_pipeline_for_two_replicas_reports_replicas_times_steps():
    # Still needed: tfdp.pipelines._upstream.set_global_steps.
    strategy = get_strategy("multiworker_local2")
    dataset = strategy.distribute_datasets_from_function(_batched)
    assert sum(1 for _ in dataset) == 5  # Global steps: 40 examples / 8.
    assert int(dataset.cardinality) == 10, "fixed upstream: remove set_global_steps"

    _upstream.set_global_steps(dataset, 5)
    assert int(dataset.cardinality) == 5  # The private attribute is still there.
    assert sum(1 for _ in dataset) == 5


def test_prefetch_to_device_hides_the_steps_per_epoch_from_keras():
    # Why make_dataset does not end with prefetch_to_device under the default
    # strategy on a GPU (pipelines/input_pipeline.py); /cpu:1 stands in for the GPU.
    x = np.zeros((40, 3), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, np.zeros(40))).batch(8)
    dataset = dataset.apply(tf.data.experimental.prefetch_to_device("/cpu:1"))
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=2, verbose=0)
    assert [w for w in caught if "ran out of data" in str(w.message)], (
        "fit now runs prefetch_to_device datasets cleanly: reconsider it in "
        "pipelines/input_pipeline.py"
    )
