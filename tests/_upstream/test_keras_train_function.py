"""Pins tfdp._upstream.keras_train_function to Keras' own multi-step train function.

tfdp.compile(steps_per_execution=N > 1) replaces Keras' train function with
one that reduces the logs once per execution; weights, logs and the end of
the data must be exactly what Keras' own function gives.
"""

import inspect
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp._upstream import keras_train_function

BATCHES, BATCH = 7, 8  # 7 batches with steps_per_execution=3: executions of 3, 3, 1


def _model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                             keras.layers.Dense(3)])


def _dataset():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(BATCHES * BATCH, 4)).astype("float32")
    y = rng.integers(0, 3, size=(BATCHES * BATCH,))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _fit(strategy, use_tfdp, **compile_kwargs):
    with strategy.scope():
        model = _model()
        compile_fn = tfdp.compile if use_tfdp else type(model).compile
        compile_fn(model, optimizer=keras.optimizers.SGD(0.3, momentum=0.5),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"], steps_per_execution=3, **compile_kwargs)
    batch_logs = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_logs.append(
            (batch, {k: float(v) for k, v in logs.items()})))
    history = model.fit(_dataset(), epochs=2, verbose=0, callbacks=[callback], shuffle=False)
    return model, history.history, batch_logs


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_matches_keras_own_train_function(replicas, accum_steps):
    def strategy():
        return (tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1
                else tfdp.make_strategy("default"))

    # Keras' own function with tfdp's step: only the train function differs.
    keras_model, keras_history, keras_batches = _fit(strategy(), use_tfdp=False)
    model, history, batches = _fit(strategy(), use_tfdp=True, accum_steps=accum_steps)
    assert "make_train_function" in vars(model)
    assert int(model.optimizer.iterations.numpy()) == 2 * BATCHES
    if accum_steps == 1:
        for want, got in zip(keras_model.weights, model.weights):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(history[key], keras_history[key], rtol=1e-6)
        assert [b for b, _ in batches] == [b for b, _ in keras_batches]
        for (_, got), (_, want) in zip(batches, keras_batches):
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    else:
        assert [b for b, _ in batches] == [b for b, _ in keras_batches]


def test_steps_are_not_converted_by_autograph_as_in_keras_own_function(monkeypatch):
    # AutoGraph re-parses the whole call tree of tfdp's step on the first
    # trace (seconds); Keras marks its own train function do_not_convert.
    # A converted function runs from AutoGraph's generated copy: a function
    # tfdp's step calls records the file its code runs from.
    from tfdp.training import fit_compile

    files = []
    tracker = fit_compile._fit_track  # pylint: disable=protected-access

    def recording_fit_track(model, normalizer):
        files.append(inspect.currentframe().f_code.co_filename)
        return tracker(model, normalizer)

    monkeypatch.setattr(fit_compile, "_fit_track", recording_fit_track)
    model = _model()
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=3)
    model.fit(_dataset().map(lambda x, y: (x, tf.one_hot(y, 3))), epochs=1, verbose=0)
    assert "make_train_function" in vars(model)
    assert files  # traced
    assert set(files) == {__file__}, files


def test_train_on_batch_still_works():
    model = _model()
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=3)
    logs = model.train_on_batch(np.zeros((BATCH, 4), "float32"), np.zeros((BATCH, 3), "float32"),
                                return_dict=True)
    assert set(logs) == {"loss"}
    assert int(model.optimizer.iterations.numpy()) == 1


class _CustomStep(keras.Sequential):
    def train_step(self, data):
        return {"custom": tf.constant(1.0)}


def test_only_where_the_step_returns_the_metrics_and_several_steps_run():
    custom = _CustomStep([keras.Input((4,)), keras.layers.Dense(3)])
    tfdp.compile(custom, optimizer="sgd", loss="mse", steps_per_execution=3,
                 loss_normalization="per_replica")
    assert "make_train_function" not in vars(custom)  # its logs are its own
    model = _model()
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=3)
    assert "make_train_function" in vars(model)
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=1)
    assert "make_train_function" not in vars(model)
    assert not keras_train_function.install(model)


def test_outside_the_known_keras_range_keras_own_function_stays_with_one_warning(monkeypatch):
    assert keras_train_function.is_supported()
    assert not keras_train_function.is_supported("3.99.0")
    monkeypatch.setattr(keras, "__version__", "3.99.0")  # what _versions reads
    monkeypatch.setattr(keras_train_function, "_warned", False)
    model = _model()
    with pytest.warns(RuntimeWarning, match=r"Keras 3\.99\.0 is outside.*keras<=3\.15"):
        tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=3)
    assert "make_train_function" not in vars(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        tfdp.compile(_model(), optimizer="sgd", loss="mse", steps_per_execution=3)
