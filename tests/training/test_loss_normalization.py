"""Every loss form Keras users write trains on 2 replicas exactly as on one device.

The matrix: loss forms (`loss_forms.FORMS`) × paths (`tfdp.compile` + fit,
with `accum_steps=2`, `tfdp.Trainer`, Trainer with `accum_steps=2`), on 2
logical CPU replicas whose halves of every global batch hold very different
numbers of valid elements and weight. Each cell's weights after 3 SGD steps
equal plain Keras `compile` + `fit` on one device to 1e-5 of the update, and
its logged loss to 1e-5. Also: the Keras behaviour tfdp works around (a
scalar loss under stock Keras gives 2× the update), `"per_replica"` equal to
stock Keras, the refused forms and their messages, and evaluation.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf
import pytest

import loss_forms
import tfdp
from strategy_testing import counting_mirrored_strategy
from loss_forms import FORMS, FORMS_BY_NAME, GLOBAL_BATCH, LEARNING_RATE
from tfdp.training import loss_normalization
from tfdp.training.batch import BatchConfig

TOLERANCE = 1e-5
PATHS = ["fit", "fit_accum2", "trainer", "trainer_accum2"]


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


_references: dict = {}


def reference(form):
    """Plain Keras on one device, computed once per form."""
    if form.name not in _references:
        _references[form.name] = loss_forms.keras_one_device(form)
    return _references[form.name]


def run_fit(form, strategy, *, accum_steps=1, loss_normalization="global"):
    with strategy.scope():
        model = form.model()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss(),
                     accum_steps=accum_steps, loss_normalization=loss_normalization,
                     **form.compile_kwargs)
    history = model.fit(form.dataset(), epochs=1, verbose=0, **form.fit_kwargs())
    return model, loss_forms.weights(model), history.history


def run_trainer(form, strategy, *, accum_steps=1):
    with strategy.scope():
        model = form.model()
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
    trainer = tfdp.Trainer(
        model, optimizer=optimizer, loss=form.loss(), strategy=strategy,
        batch=BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync, accum_steps),
    )
    logs = trainer.train(form.dataset(), steps=loss_forms.STEPS)
    return trainer, loss_forms.weights(model), logs


def run_path(form, path, strategy):
    accum_steps = 2 if path.endswith("accum2") else 1
    if path.startswith("fit"):
        _, final, history = run_fit(form, strategy, accum_steps=accum_steps)
        return final, history["loss"][-1]
    _, final, logs = run_trainer(form, strategy, accum_steps=accum_steps)
    return final, logs["loss"]


CELLS = [
    pytest.param(form.name, path, id=f"{form.name}-{path}")
    for form in FORMS for path in PATHS
    if form.trainer or path.startswith("fit")
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:tfdp. loss")
@pytest.mark.parametrize("form_name, path", CELLS)
def test_two_replicas_equal_one_device(form_name, path, two_replicas):
    form = FORMS_BY_NAME[form_name]
    initial, expected, history = reference(form)
    final, loss = run_path(form, path, two_replicas)
    deviation = loss_forms.relative_deviation(initial, expected, final)
    assert deviation < TOLERANCE, f"weights off by {deviation:.2e} of the update"
    np.testing.assert_allclose(loss, history["loss"][-1], rtol=TOLERANCE)


def _loss_scale_sgd():
    # A loss scale at which neither one device nor a replica overflows, so
    # the same steps are applied (at Keras' default 2**15 the one-device
    # gradient of this data overflows float16 where a replica's half does not).
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LEARNING_RATE),
                                               initial_scale=2.0 ** 8)


@pytest.mark.slow
@pytest.mark.parametrize("form_name", ["mse_object", "masking_layer", "mean_with_sample_weight"])
def test_mixed_float16_equals_one_device(form_name, two_replicas):
    form = FORMS_BY_NAME[form_name]
    keras.config.set_dtype_policy("mixed_float16")
    try:
        one = form.model()
        initial = loss_forms.weights(one)
        one.compile(optimizer=_loss_scale_sgd(), loss=form.loss())
        history = one.fit(form.dataset(), epochs=1, verbose=0).history
        with two_replicas.scope():
            model = form.model()
            tfdp.compile(model, optimizer=_loss_scale_sgd(), loss=form.loss(), accum_steps=2)
        tfdp_history = model.fit(form.dataset(), epochs=1, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    assert int(one.optimizer.iterations.numpy()) == loss_forms.STEPS
    assert int(model.optimizer.iterations.numpy()) == loss_forms.STEPS
    # float16 activations round alike on one device and on the replicas,
    # but not bit for bit (different batch shapes pick different kernels).
    deviation = loss_forms.relative_deviation(initial, loss_forms.weights(one),
                                              loss_forms.weights(model))
    assert deviation < 1e-3
    np.testing.assert_allclose(tfdp_history["loss"][-1], history["loss"][-1], rtol=1e-3)


def test_stock_keras_scalar_loss_gives_replicas_times_the_update(two_replicas):
    """The upstream behaviour tfdp works around: plain compile, a scalar loss, 2 replicas, 2× the update.

    Fails once Keras scales a scalar-returning loss for distribution; then the
    scalar case of `tfdp._upstream.keras_loss_terms` can follow Keras.
    """
    form = FORMS_BY_NAME["scalar_function"]
    initial = loss_forms.weights(form.model())
    with two_replicas.scope():
        model = form.model()
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss())
    model.fit(form.dataset().take(1), epochs=1, verbose=0)
    # One step each: the first layer's bias moved twice as far as on one device.
    model_one = form.model()
    model_one.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss())
    model_one.fit(form.dataset().take(1), epochs=1, verbose=0)
    stock = loss_forms.weights(model)[1] - initial[1]
    single = loss_forms.weights(model_one)[1] - initial[1]
    np.testing.assert_allclose(stock, 2.0 * single, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("form_name", ["mse_object", "masking_layer", "sample_weight"])
def test_per_replica_is_stock_keras(form_name, two_replicas):
    """`loss_normalization="per_replica"` trains as plain `model.compile` under the strategy."""
    form = FORMS_BY_NAME[form_name]
    with two_replicas.scope():
        stock = form.model()
        stock.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss())
    history = stock.fit(form.dataset(), epochs=1, verbose=0)
    _, final, tfdp_history = run_fit(form, two_replicas, loss_normalization="per_replica")
    for a, b in zip(loss_forms.weights(stock), final):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tfdp_history["loss"][-1], history.history["loss"][-1], rtol=1e-5)


@pytest.mark.slow
def test_masked_loss_differs_per_replica_but_not_globally(two_replicas):
    """The data is uneven enough that per-replica means cannot pass for the global mean."""
    form = FORMS_BY_NAME["masking_layer"]
    initial, expected, _ = reference(form)
    _, final, _ = run_fit(form, two_replicas, loss_normalization="per_replica")
    assert loss_forms.relative_deviation(initial, expected, final) > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("form_name", ["masking_layer", "sample_weight", "two_outputs_loss_weights"])
def test_evaluate_equals_one_device(form_name, two_replicas):
    form = FORMS_BY_NAME[form_name]
    one = form.model()
    one.compile(optimizer="sgd", loss=form.loss(), **form.compile_kwargs)
    expected = one.evaluate(form.dataset(), verbose=0, return_dict=True)
    with two_replicas.scope():
        model = form.model()
        tfdp.compile(model, optimizer="sgd", loss=form.loss(), **form.compile_kwargs)
    results = model.evaluate(form.dataset(), verbose=0, return_dict=True)
    assert set(results) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(results[name], value, rtol=TOLERANCE, err_msg=name)


@pytest.mark.slow
def test_trainer_evaluate_equals_one_device(two_replicas):
    form = FORMS_BY_NAME["masking_layer"]
    one = form.model()
    one.compile(optimizer="sgd", loss=form.loss())
    expected = one.evaluate(form.dataset(), verbose=0, return_dict=True)
    with two_replicas.scope():
        model = form.model()
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss=form.loss(), strategy=two_replicas,
                           batch=BatchConfig.from_global(GLOBAL_BATCH, 2))
    np.testing.assert_allclose(trainer.evaluate(form.dataset())["loss"], expected["loss"],
                               rtol=TOLERANCE)


@pytest.mark.slow
def test_two_output_losses_are_logged_as_one_device(two_replicas):
    form = FORMS_BY_NAME["two_outputs_loss_weights"]
    _, _, history = reference(form)
    _, _, tfdp_history = run_fit(form, two_replicas)
    assert set(tfdp_history) == set(history)
    for name in history:
        np.testing.assert_allclose(tfdp_history[name][-1], history[name][-1], rtol=TOLERANCE,
                                   err_msg=name)


@pytest.mark.slow
def test_scalar_loss_warns_once_naming_the_function(two_replicas):
    form = FORMS_BY_NAME["scalar_function"]
    loss_normalization._warned_scalar_losses.clear()  # pylint: disable=protected-access
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_fit(form, two_replicas)
    messages = [str(w.message) for w in caught if "returns one scalar" in str(w.message)]
    assert len(messages) == 1
    assert "scalar_mse" in messages[0] and "Return one value per example" in messages[0]


def test_reduction_none_is_refused(two_replicas):
    with two_replicas.scope():
        model = loss_forms.dense_model()
    with pytest.raises(ValueError) as raised:
        tfdp.compile(model, optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=None))
    assert str(raised.value) == (
        "Loss 'mean_squared_error' has reduction=None: it returns one value per element, "
        "which Keras differentiates as their sum and logs as their mean, so no "
        "global-batch loss matches it. Use reduction='sum' for the sum, or "
        "'sum_over_batch_size' (the default) for the mean."
    )


class _OwnLoss(keras.Sequential):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y - y_pred))


def test_compute_loss_override_is_refused_with_the_fix(two_replicas):
    with two_replicas.scope():
        model = _OwnLoss([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError) as raised:
        tfdp.compile(model, optimizer="sgd", loss="mse")
    assert str(raised.value) == (
        "_OwnLoss overrides `compute_loss`, so tfdp cannot compute its loss over the global "
        "batch: its loss would be each replica's mean, averaged (wrong under masks, uneven "
        "sample weights or a loss that returns one scalar). Give the loss to "
        "tfdp.compile(loss=...) and drop the override, or pass "
        "loss_normalization='per_replica' to keep Keras' per-replica loss."
    )
    tfdp.compile(model, optimizer="sgd", loss="mse", loss_normalization="per_replica")
    assert "train_step" not in vars(model)  # the model's own step


def test_bad_loss_normalization(two_replicas):
    with two_replicas.scope():
        model = loss_forms.dense_model()
    with pytest.raises(ValueError, match="'global' .* or 'per_replica'"):
        tfdp.compile(model, optimizer="sgd", loss="mse", loss_normalization="mean")


@pytest.mark.slow
@pytest.mark.parametrize("form_name, loss_normalization, per_step", [
    ("masking_layer", "global", 2),  # counts need the mask: one all-reduce of them
    ("mean_with_sample_weight", "global", 2),  # counts are weight sums
    ("mse_object", "global", 1),  # static batch, no mask: the counts are constants
    ("masking_layer", "per_replica", 1),
])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_count_all_reduces_per_step(form_name, loss_normalization, per_step, accum_steps):
    """At most one all-reduce of counts per optimizer step (beside the gradients'), accumulation or not."""
    strategy, counter = counting_mirrored_strategy()
    run_fit(FORMS_BY_NAME[form_name], strategy, accum_steps=accum_steps,
            loss_normalization=loss_normalization)
    assert int(counter.numpy()) == per_step * loss_forms.STEPS


@pytest.mark.slow
@pytest.mark.parametrize("form_name", ["mse_object", "scalar_function", "regularizers_add_loss"])
def test_unknown_batch_split_unevenly_over_replicas_equals_one_device(form_name, two_replicas):
    """Without a static batch the examples ride in the gradients' all-reduce.

    45 examples in batches of 16: the last global batch (13) gives the two
    replicas 7 and 6 examples, so a replica's estimate of the global examples
    (its own × 2) is wrong for that step and the optimizer must correct it.
    Also checks the deferred path adds no all-reduce of its own.
    """
    form = FORMS_BY_NAME[form_name]
    x, y = form.data()

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x[:45], y[:45])).batch(GLOBAL_BATCH)

    one = form.model()
    initial = loss_forms.weights(one)
    one.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss())
    history = one.fit(dataset(), epochs=1, verbose=0).history
    strategy, counter = counting_mirrored_strategy()
    with strategy.scope():
        model = form.model()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss())
    tfdp_history = model.fit(dataset(), epochs=1, verbose=0).history
    deviation = loss_forms.relative_deviation(initial, loss_forms.weights(one),
                                              loss_forms.weights(model))
    assert deviation < TOLERANCE, f"weights off by {deviation:.2e} of the update"
    np.testing.assert_allclose(tfdp_history["loss"][-1], history["loss"][-1], rtol=TOLERANCE)
    assert int(counter.numpy()) == 3  # one all-reduce per step: the gradients'
