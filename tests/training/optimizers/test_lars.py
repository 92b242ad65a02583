"""Tests for `tfdp.optimizers.LARS`.

Every numerical check compares with `lars_reference`, a float64 NumPy
transcription of the update in the issue / class docstring, over several
steps, with excluded and non-excluded variables and zero-norm cases.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training.lr_schedules import WarmupSchedule
from tfdp.optimizers import LARS

STEPS = 3


def lars_reference(weights, grads_per_step, *, lr, momentum, weight_decay, eeta,
                   epsilon, nesterov, decays, adapts):
    """LARS in NumPy float64; returns the weights after all steps."""
    w = [np.asarray(x, np.float64) for x in weights]
    v = [np.zeros_like(x) for x in w]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            wd = weight_decay if decays[i] else 0.0
            d = g + wd * w[i]
            w_norm, g_norm = np.linalg.norm(w[i]), np.linalg.norm(g)
            trust = 1.0
            if adapts[i] and w_norm > 0 and g_norm > 0:
                trust = eeta * w_norm / (g_norm + wd * w_norm + epsilon)
            v[i] = momentum * v[i] + lr * trust * d
            w[i] = w[i] - (momentum * v[i] + lr * trust * d if nesterov else v[i])
    return w


def make_model():
    """Dense -> LayerNorm -> Dense with a zero kernel (||w|| = 0 at step 1).

    Variable paths: dense/kernel, dense/bias, norm/gamma, norm/beta,
    zero/kernel, zero/bias.
    """
    inputs = keras.Input((3,))
    x = keras.layers.Dense(4, name="dense", bias_initializer="ones")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(2, kernel_initializer="zeros", name="zero")(x)
    return keras.Model(inputs, x, name="net")


# Default exclusions, by hand: biases and gamma/beta get neither decay nor
# adaptation; both kernels get both.
DEFAULT_FLAGS = [True, False, False, False, True, False]


def random_grads(model, rng, steps=STEPS):
    """Per-step gradients; dense/kernel's gradient is zero at step 2."""
    grads = [
        [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]
        for _ in range(steps)
    ]
    grads[1][0] = np.zeros_like(grads[1][0])
    return grads


def apply_steps(optimizer, model, grads_per_step):
    for grads in grads_per_step:
        optimizer.apply([tf.constant(g) for g in grads], model.trainable_variables)


def assert_changes_match(model, w0, expected):
    for variable, start, want in zip(model.trainable_variables, w0, expected):
        # Compare the change, so small LARS steps are checked relative to
        # their own size.
        np.testing.assert_allclose(
            variable.numpy() - start, want - start, rtol=2e-5, atol=1e-7,
            err_msg=variable.path,
        )


CASES = {
    "momentum": dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01, eeta=0.5),
    "nesterov_epsilon": dict(
        learning_rate=0.1, momentum=0.9, weight_decay=0.05, eeta=0.5, epsilon=1e-2,
        nesterov=True,
    ),
    "no_momentum_no_decay": dict(learning_rate=0.5, momentum=0.0, eeta=0.2),
    "paper_defaults": dict(learning_rate=2.0, weight_decay=5e-4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
    kwargs = CASES[case]
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    grads = random_grads(model, np.random.default_rng(0))
    optimizer = LARS(**kwargs)
    apply_steps(optimizer, model, grads)

    full = dict(momentum=0.9, weight_decay=0.0, eeta=0.001, epsilon=0.0, nesterov=False)
    full.update(kwargs)
    full["lr"] = full.pop("learning_rate")
    expected = lars_reference(w0, grads, decays=DEFAULT_FLAGS, adapts=DEFAULT_FLAGS, **full)
    assert int(optimizer.iterations.numpy()) == STEPS
    assert_changes_match(model, w0, expected)


@pytest.mark.parametrize(
    "exclusions, decays, adapts",
    [
        # Nothing excluded.
        (dict(exclude_from_weight_decay=[]), [True] * 6, [True] * 6),
        # Separate lists: no decay for biases, no adaptation for the norm layer.
        (
            dict(exclude_from_weight_decay=["bias"],
                 exclude_from_layer_adaptation=[r"^norm/"]),
            [True, False, True, True, True, False],
            [True, True, False, False, True, True],
        ),
    ],
)
def test_exclusion_lists_match_reference(exclusions, decays, adapts):
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    grads = random_grads(model, np.random.default_rng(1))
    optimizer = LARS(0.1, momentum=0.9, weight_decay=0.05, eeta=0.5, **exclusions)
    apply_steps(optimizer, model, grads)
    expected = lars_reference(
        w0, grads, lr=0.1, momentum=0.9, weight_decay=0.05, eeta=0.5, epsilon=0.0,
        nesterov=False, decays=decays, adapts=adapts,
    )
    assert_changes_match(model, w0, expected)


def test_weight_decay_is_applied_once():
    """The Keras base class's decoupled decay must not run on top of LARS's.

    With zero gradients, LARS moves a decayed variable by lr * wd * w (trust
    1) and leaves an excluded one alone; base-class decay would shrink both
    by another factor (1 - lr * wd).
    """
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    optimizer = LARS(0.1, momentum=0.0, weight_decay=0.1)
    optimizer.apply([tf.zeros_like(v) for v in w0], model.trainable_variables)
    kernel, bias = model.trainable_variables[:2]
    np.testing.assert_allclose(kernel.numpy(), w0[0] * (1 - 0.1 * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(bias.numpy(), w0[1])


def test_exclude_from_weight_decay_method():
    """Keras's `exclude_from_weight_decay()` adds patterns and variables."""
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    optimizer = LARS(0.1, momentum=0.0, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["^dense/"])
    optimizer.exclude_from_weight_decay(var_list=[model.get_layer("zero").kernel])
    assert optimizer.get_config()["exclude_from_weight_decay"][-1] == "^dense/"
    model.get_layer("zero").kernel.assign(np.ones((4, 2), "float32"))
    optimizer.apply([tf.zeros_like(v) for v in w0], model.trainable_variables)
    np.testing.assert_array_equal(model.get_layer("dense").kernel.numpy(), w0[0])
    np.testing.assert_array_equal(model.get_layer("zero").kernel.numpy(), np.ones((4, 2)))

    with pytest.raises(ValueError, match=r"only be called before the optimizer is built"):
        optimizer.exclude_from_weight_decay(var_names=["bias"])


def test_sparse_gradient_matches_dense():
    """An Embedding's IndexedSlices gradient (repeated ids) updates like its dense sum."""
    table = np.random.default_rng(2).normal(size=(5, 3)).astype("float32")
    values = np.ones((3, 3), "float32")
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant([1, 3, 1]), tf.constant([5, 3]))
    dense = tf.convert_to_tensor(sparse)
    results = []
    for grad in (sparse, dense):
        variable = keras.Variable(table, name="embeddings")
        LARS(0.1, weight_decay=0.01, eeta=0.5).apply([grad], [variable])
        results.append(variable.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    assert not np.allclose(results[0], table)


BAD_ARGUMENTS = [
    (dict(momentum=-0.1), ValueError,
     r"`momentum` must be a finite number in the range \[0.0, 1.0\)"),
    (dict(momentum=1.0), ValueError, r"Received: momentum=1.0"),
    (dict(momentum="0.9"), TypeError, r"`momentum`"),
    (dict(weight_decay=-1e-4), ValueError, r"`weight_decay` must be a finite number >= 0.0"),
    (dict(eeta=0.0), ValueError, r"`eeta` must be a finite number > 0.0"),
    (dict(epsilon=-1.0), ValueError, r"`epsilon`"),
    (dict(nesterov="yes"), TypeError, r"`nesterov` must be True or False"),
    (dict(exclude_from_weight_decay="bias"), TypeError,
     r"`exclude_from_weight_decay` must be None or a list.*\['bias'\]"),
    (dict(exclude_from_layer_adaptation=[3]), TypeError, r"`exclude_from_layer_adaptation`"),
    (dict(exclude_from_weight_decay=["(bias"]), ValueError, r"does not compile"),
    (dict(bogus=1), ValueError, r"not recognized"),
]


def test_rejects_bad_arguments():
    for kwargs, error, match in BAD_ARGUMENTS:
        with pytest.raises(error, match=match):
            LARS(0.1, **kwargs)


def test_config_round_trip_and_registered_serialisation():
    schedule = WarmupSchedule(0.2, warmup_steps=5, decay="poly", total_steps=50, power=2.0)
    optimizer = LARS(
        schedule, momentum=0.8, weight_decay=1e-4, eeta=0.01, epsilon=1e-9, nesterov=True,
        exclude_from_weight_decay=["bias", "norm"], exclude_from_layer_adaptation=["norm"],
        global_clipnorm=1.0,
    )
    config = optimizer.get_config()
    assert config["exclude_from_weight_decay"] == ["bias", "norm"]
    assert config["exclude_from_layer_adaptation"] == ["norm"]
    restored = LARS.from_config(dict(config))  # Keras replaces the lr entry in place.
    assert restored.get_config() == config

    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"] == "tfdp>LARS"
    restored = keras.optimizers.deserialize(serialized)
    assert isinstance(restored, LARS)
    assert isinstance(restored._learning_rate, WarmupSchedule)
    assert restored.get_config() == config


@pytest.mark.slow
def test_saved_model_with_warmup_schedule_loads_and_resumes(tmp_path):
    """A `.keras` file restores the optimizer, its schedule and its state."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    model = make_model()
    model.compile(
        optimizer=LARS(WarmupSchedule(0.5, warmup_steps=3, decay="cosine", total_steps=10),
                       weight_decay=1e-3, eeta=0.1),
        loss="mse",
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "lars.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)

    assert isinstance(loaded.optimizer, LARS)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer.iterations.numpy()) == 2
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for m in (model, loaded):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------
# Under a MirroredStrategy


@pytest.fixture(scope="module")
def mirrored():
    return tfdp.make_strategy("mirrored", cpu_replicas=2)


def test_custom_loop_under_mirrored_strategy_matches_reference(mirrored):
    """Replicas send different gradients; the update uses their mean.

    Each replica passes grad_r / 2 (the per-replica share of the averaged
    loss); Keras all-reduces them by SUM before `update_step`, so the trust
    ratio must see the mean gradient, not a replica's half.
    """
    rng = np.random.default_rng(4)
    with mirrored.scope():
        model = make_model()
        optimizer = LARS(0.1, momentum=0.9, weight_decay=0.01, eeta=0.5, nesterov=True)
        # Slots are created outside the tf.function, as `fit` does.
        optimizer.build(model.trainable_variables)
    w0 = [v.numpy() for v in model.trainable_variables]
    per_replica = [random_grads(model, rng, steps=2) for _ in range(2)]

    @tf.function
    def train_step(grads):
        def step_fn(replica_grads):
            optimizer.apply_gradients(zip(replica_grads, model.trainable_variables))

        mirrored.run(step_fn, args=(grads,))

    for step in range(2):
        grads = mirrored.experimental_distribute_values_from_function(
            lambda ctx, step=step: [
                tf.constant(g / 2.0)
                for g in per_replica[ctx.replica_id_in_sync_group][step]
            ]
        )
        train_step(grads)

    mean_grads = [
        [(a + b) / 2.0 for a, b in zip(per_replica[0][s], per_replica[1][s])]
        for s in range(2)
    ]
    expected = lars_reference(
        w0, mean_grads, lr=0.1, momentum=0.9, weight_decay=0.01, eeta=0.5, epsilon=0.0,
        nesterov=True, decays=DEFAULT_FLAGS, adapts=DEFAULT_FLAGS,
    )
    for variable in model.trainable_variables:
        replicas = mirrored.experimental_local_results(variable.value)
        assert len(replicas) == 2
        np.testing.assert_array_equal(replicas[0].numpy(), replicas[1].numpy())
    assert_changes_match(model, w0, expected)


@pytest.mark.slow
def test_fit_two_replicas_equals_one_device(mirrored):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    initial = make_model().get_weights()
    results = []
    for strategy in (tfdp.make_strategy("default"), mirrored):
        with strategy.scope():
            model = make_model()
            model.set_weights(initial)
            model.compile(optimizer=LARS(0.1, weight_decay=1e-3, eeta=0.5), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for one_device, two_replicas in zip(*results):
        np.testing.assert_allclose(two_replicas, one_device, rtol=1e-5, atol=1e-6)
    assert not np.allclose(results[0][0], initial[0])


def test_a_pattern_that_matches_no_variable_warns_once_with_the_paths():
    # BERT's "LayerNorm" names nothing under Keras 3 paths ("norm/gamma").
    model = make_model()
    optimizer = LARS(0.1, exclude_from_weight_decay=["LayerNorm", "bias"],
                     exclude_from_layer_adaptation=["LayerNorm", "^nowhere/"])
    with pytest.warns(UserWarning) as warned:
        optimizer.build(model.trainable_variables)
        optimizer.build(model.trainable_variables)  # built already: no second warning
    assert len(warned) == 1
    said = str(warned[0].message)
    assert "exclude_from_weight_decay: 'LayerNorm'" in said
    assert "exclude_from_layer_adaptation: '^nowhere/'" in said
    assert "'bias'" not in said  # matches dense/bias and zero/bias
    assert "'dense/kernel'" in said and "layer_normalization" in said
    # Defaults (and patterns that match) say nothing, also after a config round trip.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LARS.from_config(LARS(0.1).get_config()).build(make_model().trainable_variables)
        LARS(0.1, exclude_from_weight_decay=["norm"]).build(make_model().trainable_variables)
