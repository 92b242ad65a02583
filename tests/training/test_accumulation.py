"""Gradient accumulation through tfdp.compile and plain model.fit."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import fit_compile
from strategy_testing import counting_mirrored_strategy

FEATURES, CLASSES = 6, 3
GLOBAL_BATCH, STEPS = 32, 4


def _data(steps=STEPS, global_batch=GLOBAL_BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(steps * global_batch,)).astype("int32")
    return x, y


def _model(regularized=False):
    keras.utils.set_random_seed(7)
    regularizer = keras.regularizers.L2(0.01) if regularized else None
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer),
            keras.layers.Dense(CLASSES, kernel_regularizer=regularizer),
        ]
    )


def _fit(strategy, *, accum_steps, global_batch=GLOBAL_BATCH, steps=STEPS, regularized=False,
         steps_per_execution=1):
    x, y = _data(steps, global_batch)
    with strategy.scope():
        model = _model(regularized)
        fit_compile.compile(
            model,
            optimizer=keras.optimizers.SGD(learning_rate=0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            accum_steps=accum_steps,
            steps_per_execution=steps_per_execution,
        )
    initial = [w.numpy() for w in model.weights]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    history = model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    return model, initial, history.history


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas, accum_steps, regularized, steps_per_execution",
    [(2, 4, False, 1), (2, 4, True, 1), (4, 2, False, 3), (1, 8, True, 1)],
)
def test_accumulated_steps_equal_one_device_without_accumulation(
    replicas, accum_steps, regularized, steps_per_execution
):
    reference, initial, ref_logs = _fit(
        tfdp.make_strategy("one_device"), accum_steps=1, regularized=regularized
    )
    strategy = (
        tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1 else tfdp.make_strategy("default")
    )
    model, start, logs = _fit(
        strategy, accum_steps=accum_steps, regularized=regularized,
        steps_per_execution=steps_per_execution,
    )
    for a, b in zip(initial, start):
        np.testing.assert_array_equal(a, b)
    for begin, want, got in zip(initial, reference.weights, model.weights):
        assert np.abs(want.numpy() - begin).max() > 1e-3
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS  # optimizer steps, not micro-batches
    np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["accuracy"], ref_logs["accuracy"], rtol=1e-6)


@pytest.fixture(params=["mixed_float16", "mixed_bfloat16"])
def mixed_policy(request):
    """Sets the global dtype policy for one test; float32 again afterwards."""
    keras.config.set_dtype_policy(request.param)
    try:
        yield request.param
    finally:
        keras.config.set_dtype_policy("float32")


# Where 2 replicas × 4 micro-batches may differ from one device without
# accumulation under the same policy (measured: 5e-5 for float16, 9e-4 for
# bfloat16; the weights move by 0.14).
MIXED_ATOL = {"mixed_float16": 5e-4, "mixed_bfloat16": 5e-3}


@pytest.mark.slow
def test_mixed_precision_accumulation_on_two_replicas_matches_one_device(mixed_policy):
    reference, initial, ref_logs = _fit(tfdp.make_strategy("one_device"), accum_steps=1)
    model, start, logs = _fit(tfdp.make_strategy(cpu_replicas=2), accum_steps=4)
    assert model.dtype_policy.name == mixed_policy
    if mixed_policy == "mixed_float16":
        # tfdp's loss scaling, whose replicas agree on skipping a step.
        assert type(model.optimizer).__module__.startswith("tfdp.")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # Every global batch was one optimizer step: none skipped for an overflow.
    assert int(model.optimizer.iterations.numpy()) == STEPS
    assert np.isfinite(logs["loss"]).all()
    np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=1e-3)
    for a, b in zip(initial, start):
        np.testing.assert_array_equal(a, b)
    for variable, want in zip(model.weights, reference.weights):
        replicas = [v.numpy() for v in model.distribute_strategy.experimental_local_results(
            variable.value)]
        assert len(replicas) == 2
        np.testing.assert_array_equal(replicas[0], replicas[1])
        assert np.isfinite(replicas[0]).all()
        np.testing.assert_allclose(replicas[0], want.numpy(), atol=MIXED_ATOL[mixed_policy],
                                   rtol=0, err_msg=variable.path)


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [4, 1])
def test_one_gradient_all_reduce_per_optimizer_step(accum_steps):
    # The gradients only: with a static batch and no mask, the loss's global
    # counts are constants (tfdp.training.loss_normalization).
    strategy, counter = counting_mirrored_strategy()
    _fit(strategy, accum_steps=accum_steps)
    assert int(counter.numpy()) == STEPS


@pytest.mark.slow
def test_the_counter_sees_per_micro_batch_all_reduces():
    # Negative control: training on micro-batches without accumulation
    # all-reduces once per micro-batch, and the counter must show it.
    strategy, counter = counting_mirrored_strategy()
    _fit(strategy, accum_steps=1, global_batch=GLOBAL_BATCH // 4, steps=STEPS * 4)
    assert int(counter.numpy()) == 4 * STEPS


def test_indivisible_static_replica_batch_names_the_fix():
    x, y = _data()
    model = _model()
    fit_compile.compile(model, optimizer="sgd", loss="sparse_categorical_crossentropy",
                         accum_steps=3)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
    with pytest.raises(ValueError, match="drop_remainder=True") as error:
        model.fit(dataset, epochs=1, verbose=0)
    assert "replica batch of 32 examples" in str(error.value)


def test_indivisible_final_batch_fails_at_run_time_with_the_fix():
    x, y = _data(steps=5)
    model = _model()
    fit_compile.compile(model, optimizer="sgd", loss="sparse_categorical_crossentropy",
                         accum_steps=4)
    # 130 examples in batches of 32: the last batch has 2, which 4 cannot split.
    dataset = tf.data.Dataset.from_tensor_slices((x[:130], y[:130])).batch(32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="drop_remainder=True"):
        model.fit(dataset, epochs=1, verbose=0)


@pytest.mark.parametrize("accum_steps", [0, -1, 2.0, True])
def test_bad_accum_steps(accum_steps):
    with pytest.raises(ValueError, match="`accum_steps` must be a positive integer"):
        fit_compile.compile(_model(), optimizer="sgd", loss="mse", accum_steps=accum_steps)


@pytest.mark.parametrize("steps_per_execution", [0, -2, 3.0, True, "4"])
def test_bad_steps_per_execution(steps_per_execution):
    with pytest.raises(ValueError, match="`steps_per_execution` must be a positive integer"):
        fit_compile.compile(_model(), optimizer="sgd", loss="mse",
                            steps_per_execution=steps_per_execution)


def test_numpy_steps_per_execution_reaches_keras_as_an_int():
    model = fit_compile.compile(_model(), optimizer="sgd", loss="mse",
                                steps_per_execution=np.int64(3))
    assert model.steps_per_execution == 3 and type(model.steps_per_execution) is int


def test_keras_gradient_accumulation_is_refused_with_the_fix():
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="accum_steps=4 to tfdp.compile"):
        fit_compile.compile(_model(), optimizer=optimizer, loss="mse")


def test_recompiling_replaces_the_step():
    model = _model()
    fit_compile.compile(model, optimizer="sgd", loss="mse", accum_steps=2)
    assert model.train_step.args[2] == 2
    fit_compile.compile(model, optimizer="sgd", loss="mse", accum_steps=1)
    assert model.train_step.args[2] == 1


def test_keras_own_accumulation_still_fails_under_mirrored_strategy():
    """keras-team/keras#20582: fails once upstream works, and tfdp's refusal can go."""
    x, y = _data()
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    with pytest.raises(RuntimeError, match="merge_call"):
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)


@pytest.mark.slow
def test_jit_compiled_accumulation_matches_one_device():
    reference, _, _ = _fit(tfdp.make_strategy("one_device"), accum_steps=1)
    x, y = _data()
    model = _model()
    fit_compile.compile(
        model, optimizer=keras.optimizers.SGD(learning_rate=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        accum_steps=4, jit_compile=True,
    )
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    for want, got in zip(reference.weights, model.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)


def test_jit_compile_on_several_cpu_replicas_is_refused():
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = _model()
        with pytest.raises(ValueError, match="jit_compile=True cannot run on a MirroredStrategy"):
            fit_compile.compile(model, optimizer="sgd", loss="mse", accum_steps=2,
                                 jit_compile=True)


class _WithUnusedBranch(keras.Model):
    """A classifier with a Dense layer whose output the loss never sees."""

    def __init__(self):
        super().__init__(name="with_unused_branch")
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(CLASSES)
        # Its bias (non-zero, so weight decay would move it) is the model's
        # smallest variable, the one a non-finite loss used to be folded into.
        self.unused = keras.layers.Dense(2, bias_initializer="ones")

    def call(self, x):
        self.unused(x)  # built and trainable, but no gradient reaches it
        return self.head(self.hidden(x))


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [2, 1])
def test_variables_without_a_gradient_are_left_alone_as_keras_does(accum_steps):
    # AdamW's weight decay (and Adam's bias correction) moves a variable that
    # gets a zero gradient; Keras skips variables whose gradient is None.
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    results = {}
    for name in ("keras", "tfdp"):
        strategy = tfdp.make_strategy(cpu_replicas=2)
        with strategy.scope():
            keras.utils.set_random_seed(7)
            model = _WithUnusedBranch()
            model(x[:1])
            optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            if name == "keras":
                model.compile(optimizer=optimizer, loss=loss)
            else:
                fit_compile.compile(model, optimizer=optimizer, loss=loss,
                                    accum_steps=accum_steps)
        unused_before = [w.numpy() for w in model.unused.weights]
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
        for before, after in zip(unused_before, model.unused.weights):
            np.testing.assert_array_equal(after.numpy(), before, err_msg=name)
        results[name] = [w.numpy() for w in model.weights]
    for got, want in zip(results["tfdp"], results["keras"]):
        np.testing.assert_allclose(got, want, atol=2e-5)


class _OwnStep(keras.Sequential):
    def train_step(self, data):  # pragma: no cover - never run: refused
        return super().train_step(data)


@pytest.mark.parametrize("loss_normalization", ["global", "per_replica"])
def test_a_model_with_its_own_train_step_is_refused_under_accumulation(loss_normalization):
    # tfdp.compile would have to replace the model's step to accumulate:
    # refused, never silently replaced (nor the accumulation dropped).
    model = _OwnStep([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    with pytest.raises(ValueError, match=r"_OwnStep overrides `train_step`, so tfdp cannot "
                       r"accumulate gradients through it.*accum_steps=1"):
        fit_compile.compile(model, optimizer="sgd", loss="mse", accum_steps=2,
                            loss_normalization=loss_normalization)
    assert "train_step" not in vars(model)
    fit_compile.compile(model, optimizer="sgd", loss="mse", loss_normalization="per_replica")
    assert "train_step" not in vars(model)  # accum_steps=1: the model's own step runs
