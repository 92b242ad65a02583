"""The digits CNN trains: one step lowers the loss, also on two replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import models
import tfdp


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    return x, y


@pytest.mark.parametrize("replicas", [1, 2])
def test_one_sgd_step_lowers_the_loss(replicas):
    strategy = tfdp.make_strategy(cpu_replicas=2) if replicas > 1 else tfdp.make_strategy("default")
    x, y = _data()
    with strategy.scope():
        model = models.get("cnn", input_shape=(8, 8, 1), num_classes=10, dropout=0.0)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    before = model.evaluate(batch, verbose=0)
    model.fit(batch, epochs=1, verbose=0, shuffle=False)
    after = model.evaluate(batch, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert after < before
