"""Training and evaluation leave the caller's NumPy arrays as they were.

Batches from Python (`keras.utils.PyDataset`, `from_generator`) reach the
replicas as slices of the caller's arrays, and under two replicas
TensorFlow writes a step's intermediate results into them
(`tfdp/_upstream/numpy_aliased_inputs.py`). Here a `Rescaling` first layer
and `mse` would write into the images and the labels. The arrays are
64-byte aligned so that TensorFlow shares their memory every time (an
unaligned array is copied, and nothing shows).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from aligned_arrays import aligned_ones

ROWS, FEATURES, BATCH = 32, 4, 8


def _arrays():
    x = aligned_ones((ROWS, FEATURES))
    x *= np.random.default_rng(0).uniform(0.5, 1.5, size=(ROWS, FEATURES)).astype(np.float32)
    y = aligned_ones((ROWS,))
    y[::2] = 0.0
    return x, y


class _Batches(keras.utils.PyDataset):
    """Consecutive slices (views) of `x` and `y`, as a user's PyDataset returns them."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return ROWS // BATCH

    def __getitem__(self, index):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def _model():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Rescaling(2.0),
                             keras.layers.Dense(3, "relu"), keras.layers.Dense(1)])


def _fit_and_evaluate(compile_fn, x, y):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = _model()
        compile_fn(model, optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(_Batches(x, y), epochs=2, verbose=0)
    model.evaluate(_Batches(x, y), verbose=0)


@pytest.mark.slow
def test_stock_keras_writes_into_the_callers_arrays():
    # What tfdp.compile prevents (and the proof that this set-up shows it).
    x, y = _arrays()
    x0, y0 = x.copy(), y.copy()
    _fit_and_evaluate(keras.Model.compile, x, y)
    assert not (np.array_equal(x, x0) and np.array_equal(y, y0))


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_tfdp_compile_fit_and_evaluate_leave_them(accum_steps):
    x, y = _arrays()
    x0, y0 = x.copy(), y.copy()

    def compile_fn(model, **kwargs):
        tfdp.compile(model, accum_steps=accum_steps, **kwargs)

    _fit_and_evaluate(compile_fn, x, y)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)


@pytest.mark.slow
def test_trainer_train_and_evaluate_leave_them():
    x, y = _arrays()
    x0, y0 = x.copy(), y.copy()
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.SGD(0.01)
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                           batch=tfdp.BatchConfig.from_global(BATCH, 2))

    def dataset():
        return tf.data.Dataset.from_generator(
            lambda: ((x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, ROWS, BATCH)),
            output_signature=(tf.TensorSpec([None, FEATURES], tf.float32),
                              tf.TensorSpec([None], tf.float32)))

    trainer.train(dataset(), steps=ROWS // BATCH)
    trainer.evaluate(dataset())
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)
