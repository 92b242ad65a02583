"""Pins tfdp._upstream.keras_train_step to Keras' own train step.

If Keras changes what its TensorFlow train_step does around the forward pass
and loss, tfdp's accumulation (which reuses that part) would drift from it;
this test fails first.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from tfdp.training import accumulation


def _fit(use_tfdp_step):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(7, activation="relu", kernel_regularizer="l2"),
            keras.layers.Dropout(0.0),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if use_tfdp_step:
        model.train_step = functools.partial(accumulation.accumulating_train_step, model, 1)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.integers(0, 2, size=64)
    weights = rng.uniform(0.5, 1.5, size=64).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(16)
    history = model.fit(dataset, epochs=2, verbose=0)
    return model, history.history


def test_single_micro_batch_step_matches_keras_train_step():
    keras_model, keras_logs = _fit(use_tfdp_step=False)
    tfdp_model, tfdp_logs = _fit(use_tfdp_step=True)
    for want, got in zip(keras_model.weights, tfdp_model.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(tfdp_logs[key], keras_logs[key], rtol=1e-6)
