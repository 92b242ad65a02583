"""Pins tfdp._upstream.keras_loss_terms to Keras' own loss reduction and compiled loss.

On one device, `numerator / count` must be exactly what Keras' loss returns,
for every reduction, with and without sample weights and masks; and the
compiled terms must add up to `model.compute_loss`. A Keras change to the
code `split_loss` repeats fails here first.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src import backend as keras_backend

from tfdp._upstream import keras_loss_terms

REDUCTIONS = ["sum_over_batch_size", "mean", "sum", "mean_with_sample_weight"]


def _masked(values, mask):
    tensor = tf.convert_to_tensor(values)
    keras_backend.set_keras_mask(tensor, tf.convert_to_tensor(mask))
    return tensor


def _cases():
    rng = np.random.default_rng(0)
    y_true = rng.normal(size=(6, 5, 2)).astype("float32")
    y_pred = rng.normal(size=(6, 5, 2)).astype("float32")
    mask = rng.random((6, 5)) > 0.4
    weight = rng.random((6, 1)).astype("float32") + 0.1  # per example, broadcast over steps
    step_weight = rng.random((6, 5)).astype("float32")
    return {
        "plain": (y_true, y_pred, None, None),
        "example_weights": (y_true, y_pred, weight, None),
        "step_weights": (y_true, y_pred, step_weight, None),
        "mask": (y_true, y_pred, None, mask),
        "mask_and_weights": (y_true, y_pred, weight, mask),
        "all_masked": (y_true, y_pred, None, np.zeros((6, 5), bool)),
    }


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(_cases()))
def test_numerator_over_count_is_keras_loss(reduction, case):
    y_true, y_pred, weight, mask = _cases()[case]
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    pred = y_pred if mask is None else _masked(y_pred, mask)
    expected = float(loss(y_true, pred, sample_weight=weight))
    pred = y_pred if mask is None else _masked(y_pred, mask)
    split = keras_loss_terms.split_loss(loss, y_true, pred, weight)
    got = float(tf.math.divide_no_nan(split.numerator, split.count))
    assert split.kind == (keras_loss_terms.SUM if reduction == "sum" else keras_loss_terms.COUNT)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_sparse_crossentropy_under_an_embedding_mask():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, size=(3, 7))
    logits = rng.normal(size=(3, 7, 4)).astype("float32")
    mask = np.arange(7)[None, :] < np.array([[2], [7], [4]])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = float(loss(labels, _masked(logits, mask)))
    split = keras_loss_terms.split_loss(loss, labels, _masked(logits, mask))
    np.testing.assert_allclose(float(split.numerator / split.count), expected, rtol=1e-6)
    assert float(split.count) == mask.sum()


def test_a_scalar_is_weighted_by_its_examples():
    y_true, y_pred = np.ones((4, 3), "float32"), np.zeros((4, 3), "float32")
    loss = keras_loss_terms.resolve_loss(lambda t, p: tf.reduce_mean(tf.abs(t - p)), y_true, y_pred)
    split = keras_loss_terms.split_loss(loss, y_true, y_pred)
    assert split.kind == keras_loss_terms.EXAMPLES
    assert float(split.numerator) == 4.0 and float(split.count) == 4.0
    # Keras returns such a scalar unscaled: the behaviour tfdp's scaling replaces.
    assert float(loss(y_true, y_pred)) == 1.0


def test_compiled_terms_add_up_to_compute_loss():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(inputs),
                                 "b": keras.layers.Dense(2, name="b")(inputs)})
    model.compile(loss={"a": "mse", "b": keras.losses.MeanAbsoluteError(reduction="sum")},
                  loss_weights={"a": 0.3, "b": 1.5})
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 3)).astype("float32")
    y = {"a": rng.normal(size=(5, 1)).astype("float32"),
         "b": rng.normal(size=(5, 2)).astype("float32")}
    y_pred = model(x)
    expected = float(model.compute_loss(x, y, y_pred))
    terms, targets = keras_loss_terms.compiled_terms(model, y, y_pred)
    assert len(terms) == 2
    total = 0.0
    for term in terms:
        split = keras_loss_terms.split_loss(
            term.loss, keras_loss_terms.select(term.path, targets),
            keras_loss_terms.select(term.path, y_pred),
        )
        total += term.weight * float(split.numerator / split.count)
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert all(term.metric is not None for term in terms)  # <output>_loss


def test_mask_producers_are_found():
    masked = keras.Sequential([keras.Input((4, 2)), keras.layers.Masking(), keras.layers.Dense(1)])
    embedded = keras.Sequential([keras.Input((4,)), keras.layers.Embedding(5, 2, mask_zero=True)])
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Embedding(5, 2),
                              keras.layers.Dense(1)])
    assert keras_loss_terms.may_produce_mask(masked)
    assert keras_loss_terms.may_produce_mask(embedded)
    assert not keras_loss_terms.may_produce_mask(plain)


def test_synchronized_batch_normalization_is_found_inside_nested_layers():
    class Block(keras.layers.Layer):
        def __init__(self, synchronized):
            super().__init__()
            self.norm = keras.layers.BatchNormalization(synchronized=synchronized)

        def call(self, inputs):
            return self.norm(inputs)

    def model(synchronized):
        return keras.Sequential([keras.Input((3,)), Block(synchronized), keras.layers.Dense(1)])

    assert keras_loss_terms.runs_collectives_in_forward(model(True))
    assert not keras_loss_terms.runs_collectives_in_forward(model(False))


def test_version_gate():
    assert keras_loss_terms.is_supported()
    assert not keras_loss_terms.is_supported("3.99.0")
    assert not keras_loss_terms.is_supported("2.15.0")


def test_an_unknown_keras_warns_once_for_compile_and_trainer(monkeypatch):
    import tfdp

    strategy = tfdp.make_strategy(cpu_replicas=2)  # before faking: it checks the version too
    monkeypatch.setattr(keras, "__version__", "3.99.0")  # what _versions reads
    monkeypatch.setattr(keras_loss_terms, "_warned_version", False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.warns(RuntimeWarning) as warned:
        tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                     batch=tfdp.BatchConfig(2, 2))
        tfdp.compile(model, optimizer="sgd", loss="mse")
    said = [str(w.message) for w in warned if "loss normalisation" in str(w.message)]
    assert len(said) == 1, said  # once per process
    for expected in ("Keras 3.99.0", "reduce_values", "test_keras_loss_terms.py",
                     "keras<=3.15"):
        assert expected in said[0], said[0]
