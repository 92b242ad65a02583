"""Tests for `tfdp.optimizers.LAMB`.

Every numerical check compares with `lamb_reference`, a float64 NumPy
transcription of You et al. (2019), Algorithm 2, as written in the class
docstring, over several steps, with excluded and non-excluded variables and
zero-norm cases; plus the cases where it must agree with
`keras.optimizers.Lamb`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training.lr_schedules import WarmupSchedule
from tfdp.optimizers import LAMB

STEPS = 3


def lamb_reference(weights, grads_per_step, *, lrs, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                   weight_decay=0.0, decays, adapts):
    """LAMB in NumPy float64; `lrs[t]` is the learning rate of step t (from 0)."""
    w = [np.asarray(x, np.float64) for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g**2
            m_hat = m[i] / (1 - beta_1**t)
            v_hat = v[i] / (1 - beta_2**t)
            r = m_hat / (np.sqrt(v_hat) + epsilon)
            if decays[i]:
                r = r + weight_decay * w[i]
            w_norm, r_norm = np.linalg.norm(w[i]), np.linalg.norm(r)
            trust = w_norm / r_norm if adapts[i] and w_norm > 0 and r_norm > 0 else 1.0
            w[i] = w[i] - lrs[t - 1] * trust * r
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
    """Per-step gradients; dense/kernel's gradient is zero at step 1.

    Without weight decay that makes r = 0 for dense/kernel at step 1 (the
    ||r|| = 0 case); zero/kernel starts at 0 (the ||w|| = 0 case).
    """
    grads = [
        [rng.normal(size=v.shape).astype("float32") for v in model.trainable_variables]
        for _ in range(steps)
    ]
    grads[0][0] = np.zeros_like(grads[0][0])
    return grads


def apply_steps(optimizer, model, grads_per_step):
    for grads in grads_per_step:
        optimizer.apply([tf.constant(g) for g in grads], model.trainable_variables)


def assert_changes_match(model, w0, expected, rtol=2e-5):
    for variable, start, want in zip(model.trainable_variables, w0, expected):
        got = variable.numpy()
        assert np.all(np.isfinite(got)), variable.path
        # Compare the change, relative to its own size.
        np.testing.assert_allclose(got - start, want - start, rtol=rtol, atol=1e-7,
                                   err_msg=variable.path)


@pytest.mark.parametrize(
    "kwargs, decays, adapts",
    [
        (dict(weight_decay=0.01), DEFAULT_FLAGS, DEFAULT_FLAGS),
        (dict(beta_1=0.8, beta_2=0.99, epsilon=1e-3), DEFAULT_FLAGS, DEFAULT_FLAGS),
        (dict(weight_decay=0.1, exclude_from_weight_decay=[]), [True] * 6, [True] * 6),
        # No decay for biases, no adaptation for the norm layer.
        (
            dict(weight_decay=0.05, exclude_from_weight_decay=["bias"],
                 exclude_from_layer_adaptation=[r"^norm/"]),
            [True, False, True, True, True, False],
            [True, True, False, False, True, True],
        ),
    ],
    ids=["default_exclusions", "no_decay", "nothing_excluded", "separate_lists"],
)
def test_matches_numpy_reference(kwargs, decays, adapts):
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    grads = random_grads(model, np.random.default_rng(0))
    apply_steps(LAMB(0.05, **kwargs), model, grads)

    reference_kwargs = {k: v for k, v in kwargs.items() if not k.startswith("exclude")}
    expected = lamb_reference(w0, grads, lrs=[0.05] * STEPS, decays=decays, adapts=adapts,
                              **reference_kwargs)
    assert_changes_match(model, w0, expected)


def test_schedule_is_indexed_by_optimizer_step():
    schedule = WarmupSchedule(0.1, warmup_steps=2, decay="poly", total_steps=4)
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    grads = random_grads(model, np.random.default_rng(1), steps=4)
    apply_steps(LAMB(schedule, weight_decay=0.01), model, grads)
    lrs = [0.05, 0.1, 0.1, 0.05]  # warmup (s+1)/2, then linear decay to 0 at step 4
    expected = lamb_reference(w0, grads, lrs=lrs, weight_decay=0.01,
                              decays=DEFAULT_FLAGS, adapts=DEFAULT_FLAGS)
    assert_changes_match(model, w0, expected)


def test_agrees_with_keras_lamb_without_weight_decay_and_differs_with_it():
    initial = make_model().get_weights()
    grads = random_grads(make_model(), np.random.default_rng(2))
    results = {}
    for name, weight_decay in [("no_decay", 0.0), ("decay", 0.1)]:
        for cls in ("tfdp", "keras"):
            model = make_model()
            model.set_weights(initial)
            if cls == "tfdp":
                optimizer = LAMB(0.05, epsilon=1e-7, weight_decay=weight_decay,
                                 exclude_from_weight_decay=[])
            else:
                optimizer = keras.optimizers.Lamb(0.05, epsilon=1e-7,
                                                  weight_decay=weight_decay or None)
            apply_steps(optimizer, model, grads)
            results[name, cls] = model.get_weights()
    for ours, theirs in zip(results["no_decay", "tfdp"], results["no_decay", "keras"]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    # Keras decays outside the trust ratio (keras-team/keras#19981).
    assert not np.allclose(results["decay", "tfdp"][0], results["decay", "keras"][0])


def test_weight_decay_is_applied_once():
    """The Keras base class's decoupled decay must not run on top of LAMB's.

    With zero gradients, m = v = 0, so r = wd * w and trust = 1 / wd: a
    decayed variable becomes (1 - lr) * w and an excluded one (r = 0) stays.
    Base-class decay would first shrink both by (1 - lr * wd).
    """
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    optimizer = LAMB(0.1, weight_decay=0.5)
    optimizer.apply([tf.zeros_like(v) for v in w0], model.trainable_variables)
    kernel, bias = model.trainable_variables[:2]
    np.testing.assert_allclose(kernel.numpy(), w0[0] * (1 - 0.1), rtol=1e-6)
    np.testing.assert_array_equal(bias.numpy(), w0[1])


def test_gradient_accumulation_uses_accumulated_steps():
    """Two accumulated micro-steps = one LAMB step (t = 1, 2) on their mean."""
    model = make_model()
    w0 = [v.numpy() for v in model.trainable_variables]
    micro = random_grads(model, np.random.default_rng(3), steps=4)
    apply_steps(LAMB(0.05, weight_decay=0.01, gradient_accumulation_steps=2), model, micro)
    mean = [[(a + b) / 2 for a, b in zip(micro[2 * s], micro[2 * s + 1])] for s in range(2)]
    expected = lamb_reference(w0, mean, lrs=[0.05, 0.05], weight_decay=0.01,
                              decays=DEFAULT_FLAGS, adapts=DEFAULT_FLAGS)
    assert_changes_match(model, w0, expected)


BAD_ARGUMENTS = [
    (dict(beta_1=1.0), ValueError,
     r"`beta_1` must be a finite number in the range \[0.0, 1.0\)"),
    (dict(beta_2=-0.5), ValueError, r"Received: beta_2=-0.5"),
    (dict(epsilon=0.0), ValueError, r"`epsilon` must be a finite number > 0.0"),
    (dict(weight_decay=-0.01), ValueError, r"`weight_decay` must be a finite number >= 0.0"),
    (dict(weight_decay=None), TypeError, r"`weight_decay`"),
    (dict(exclude_from_weight_decay="LayerNorm"), TypeError,
     r"pass a list: exclude_from_weight_decay=\['LayerNorm'\]"),
    (dict(exclude_from_layer_adaptation=["[norm"]), ValueError, r"does not compile"),
]


def test_rejects_bad_arguments():
    for kwargs, error, match in BAD_ARGUMENTS:
        with pytest.raises(error, match=match):
            LAMB(1e-3, **kwargs)


def test_config_round_trip_and_registered_serialisation():
    optimizer = LAMB(
        WarmupSchedule(1e-3, warmup_steps=10, decay="cosine", total_steps=100),
        beta_1=0.85, beta_2=0.99, epsilon=1e-8, weight_decay=0.01,
        exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"], clipnorm=1.0,
    )
    config = optimizer.get_config()
    assert config["epsilon"] == 1e-8 and config["weight_decay"] == 0.01
    assert config["exclude_from_layer_adaptation"] == ["LayerNorm", "layer_norm", "bias"]
    restored = LAMB.from_config(dict(config))  # Keras replaces the lr entry in place.
    assert restored.get_config() == config

    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"] == "tfdp>LAMB"
    restored = keras.optimizers.deserialize(serialized)
    assert isinstance(restored, LAMB) and restored.get_config() == config


@pytest.mark.slow
def test_saved_model_with_warmup_schedule_loads_and_resumes(tmp_path):
    """A `.keras` file restores the optimizer, its schedule and its moments."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    model = make_model()
    model.compile(
        optimizer=LAMB(WarmupSchedule(0.01, warmup_steps=2, decay="poly", total_steps=10),
                       weight_decay=0.01),
        loss="mse",
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "lamb.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)

    assert isinstance(loaded.optimizer, LAMB)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
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
    """Replicas send different gradients; moments and norms use their mean."""
    rng = np.random.default_rng(5)
    with mirrored.scope():
        model = make_model()
        optimizer = LAMB(0.05, weight_decay=0.01)
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
    expected = lamb_reference(w0, mean_grads, lrs=[0.05, 0.05], weight_decay=0.01,
                              decays=DEFAULT_FLAGS, adapts=DEFAULT_FLAGS)
    for variable in model.trainable_variables:
        replicas = mirrored.experimental_local_results(variable.value)
        np.testing.assert_array_equal(replicas[0].numpy(), replicas[1].numpy())
    assert_changes_match(model, w0, expected)


@pytest.mark.slow
def test_fit_two_replicas_equals_one_device(mirrored):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    initial = make_model().get_weights()
    results = []
    for strategy in (tfdp.make_strategy("default"), mirrored):
        with strategy.scope():
            model = make_model()
            model.set_weights(initial)
            model.compile(optimizer=LAMB(0.01, weight_decay=0.01), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for one_device, two_replicas in zip(*results):
        np.testing.assert_allclose(two_replicas, one_device, rtol=1e-5, atol=1e-6)
    assert not np.allclose(results[0][0], initial[0])
