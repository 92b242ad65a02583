"""Pins tfdp._upstream.keras_train_function to Keras' own multi-step train and test functions.

tfdp.compile(steps_per_execution=N > 1) replaces Keras' train and test
functions with ones that reduce the logs once per execution; weights, logs
(validation and `evaluate` included) and the end of the data must be
exactly what Keras' own functions give.
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
    history = model.fit(_dataset(), epochs=2, verbose=0, callbacks=[callback], shuffle=False,
                        validation_data=_dataset().take(BATCHES - 2))
    return model, history.history, batch_logs


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_matches_keras_own_train_function(replicas, accum_steps):
    def strategy():
        return (tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1
                else tfdp.make_strategy("default"))

    # Keras' own function with tfdp's step: only the train function differs.
    keras_model, keras_history, keras_batches = _fit(strategy(), use_tfdp=False)
    model, history, batches = _fit(strategy(), use_tfdp=True, accum_steps=accum_steps)
    assert "make_train_function" in vars(model) and "make_test_function" in vars(model)
    assert int(model.optimizer.iterations.numpy()) == 2 * BATCHES
    if accum_steps == 1:
        for want, got in zip(keras_model.weights, model.weights):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            np.testing.assert_allclose(history[key], keras_history[key], rtol=1e-6)
        # evaluate: 7 batches in executions of 3, 3, 1, and a `steps` bound.
        for steps in (None, 2):
            want = keras_model.evaluate(_dataset(), steps=steps, verbose=0, return_dict=True)
            got = model.evaluate(_dataset(), steps=steps, verbose=0, return_dict=True)
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
        assert [b for b, _ in batches] == [b for b, _ in keras_batches]
        for (_, got), (_, want) in zip(batches, keras_batches):
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    else:
        assert [b for b, _ in batches] == [b for b, _ in keras_batches]


@pytest.mark.slow
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


def test_train_on_batch_and_test_on_batch_still_work():
    model = _model()
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=3)
    x, y = np.zeros((BATCH, 4), "float32"), np.ones((BATCH, 3), "float32")
    logs = model.train_on_batch(x, y, return_dict=True)
    assert set(logs) == {"loss"}
    assert int(model.optimizer.iterations.numpy()) == 1
    logs = model.test_on_batch(x, y, return_dict=True)
    want = float(np.mean((model.predict_on_batch(x) - y) ** 2))
    np.testing.assert_allclose(logs["loss"], want, rtol=1e-6)


def test_evaluate_of_an_empty_dataset_runs_no_step_as_keras_does():
    empty = _dataset().take(0).map(lambda x, y: (x, tf.one_hot(y, 3)))
    for compile_fn in (tfdp.compile, keras.Model.compile):
        model = _model()
        compile_fn(model, optimizer="sgd", loss="mse", steps_per_execution=3)
        assert ("make_test_function" in vars(model)) == (compile_fn is tfdp.compile)
        with pytest.warns(UserWarning, match="ran out of data"):
            assert model.evaluate(empty, verbose=0, return_dict=True) == {}


class _CustomStep(keras.Sequential):
    def train_step(self, data):
        return {"custom": tf.constant(1.0)}


class _CustomTestStep(keras.Sequential):
    def test_step(self, data):
        return {"custom": tf.constant(2.0)}


def test_only_where_the_step_returns_the_metrics_and_several_steps_run():
    custom = _CustomStep([keras.Input((4,)), keras.layers.Dense(3)])
    tfdp.compile(custom, optimizer="sgd", loss="mse", steps_per_execution=3,
                 loss_normalization="per_replica")
    assert "make_train_function" not in vars(custom)  # its logs are its own
    assert "make_test_function" in vars(custom)
    custom_test = _CustomTestStep([keras.Input((4,)), keras.layers.Dense(3)])
    tfdp.compile(custom_test, optimizer="sgd", loss="mse", steps_per_execution=3,
                 loss_normalization="per_replica")
    assert "make_train_function" in vars(custom_test)
    assert "make_test_function" not in vars(custom_test)
    data = _dataset().map(lambda x, y: (x, tf.one_hot(y, 3)))
    assert custom_test.evaluate(data, verbose=0, return_dict=True) == {"custom": 2.0}
    model = _model()
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=3)
    assert "make_train_function" in vars(model) and "make_test_function" in vars(model)
    tfdp.compile(model, optimizer="sgd", loss="mse", steps_per_execution=1)
    assert "make_train_function" not in vars(model)
    assert "make_test_function" not in vars(model)
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
    assert "make_test_function" not in vars(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        tfdp.compile(_model(), optimizer="sgd", loss="mse", steps_per_execution=3)
