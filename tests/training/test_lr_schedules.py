"""Tests for `tfdp.training.lr_schedules`: `scale_lr` and `WarmupSchedule`.

Schedule values are compared step by step with a NumPy transcription of the
formulas in the `WarmupSchedule` docstring, at the warmup, decay and
boundary steps, plus a few values worked out by hand.
"""

import math

import keras
import numpy as np
import pytest

import tfdp
from tfdp.training.lr_schedules import WarmupSchedule, scale_lr


# --------------------------------------------------------------------------
# scale_lr


@pytest.mark.parametrize(
    "rule, expected",
    [("linear", 3.2), ("sqrt", 0.1 * math.sqrt(32.0)), ("none", 0.1)],
)
def test_scale_lr_rules(rule, expected):
    scaled = scale_lr(0.1, 256, 8192, rule=rule)
    assert type(scaled) is float
    assert scaled == pytest.approx(expected, rel=1e-12)


def test_scale_lr_defaults_to_linear_and_scales_down():
    assert scale_lr(0.4, 1024, 256) == pytest.approx(0.1, rel=1e-12)


# Bad-input cases run in one test each (not parametrised): every test pays for
# the shared Keras-state reset, and these checks are pure Python.
SCALE_LR_BAD_INPUT = [
    ((0.0, 256, 512), {}, ValueError, r"`base_lr` must be a finite number > 0"),
    ((-0.1, 256, 512), {}, ValueError, r"Received: base_lr=-0.1"),
    ((float("nan"), 256, 512), {}, ValueError, r"`base_lr`"),
    (("0.1", 256, 512), {}, TypeError, r"`base_lr`.*Received: base_lr='0.1'"),
    ((0.1, 0, 512), {}, ValueError, r"`base_batch` must be a positive integer"),
    ((0.1, 256, -4), {}, ValueError, r"Received: global_batch=-4"),
    ((0.1, 256.0, 512), {}, TypeError, r"`base_batch` must be a positive integer"),
    ((0.1, 256, True), {}, TypeError, r"`global_batch`"),
    ((0.1, 256, 512), {"rule": "quadratic"}, ValueError,
     r"`rule` must be one of 'linear', 'sqrt', 'none'\. Received: rule='quadratic'"),
]


def test_scale_lr_rejects_bad_input():
    for args, kwargs, error, match in SCALE_LR_BAD_INPUT:
        with pytest.raises(error, match=match):
            scale_lr(*args, **kwargs)


# --------------------------------------------------------------------------
# WarmupSchedule values


def reference_lr(step, peak, warmup=0, decay="constant", total=None, end=0.0,
                 power=1.0, boundaries=(), rate=0.1):
    """The `WarmupSchedule` docstring's formulas, in NumPy float64."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay == "constant":
        return peak
    if decay == "step":
        return peak * rate ** sum(step >= b for b in boundaries)
    t = min(step - warmup, total - warmup)
    fraction = t / (total - warmup)
    if decay == "cosine":
        return end + (peak - end) * 0.5 * (1.0 + np.cos(np.pi * fraction))
    return end + (peak - end) * (1.0 - fraction) ** power


CASES = {
    "constant": (
        dict(peak_lr=0.8, warmup_steps=4),
        dict(peak=0.8, warmup=4),
    ),
    "cosine": (
        dict(peak_lr=0.5, warmup_steps=5, decay="cosine", total_steps=20, end_lr=0.01),
        dict(peak=0.5, warmup=5, decay="cosine", total=20, end=0.01),
    ),
    "cosine_no_warmup": (
        dict(peak_lr=0.3, decay="cosine", total_steps=10),
        dict(peak=0.3, decay="cosine", total=10),
    ),
    "poly": (
        dict(peak_lr=2.0, warmup_steps=3, decay="poly", total_steps=13, end_lr=0.001,
             power=2.0),
        dict(peak=2.0, warmup=3, decay="poly", total=13, end=0.001, power=2.0),
    ),
    "poly_linear_to_zero": (
        dict(peak_lr=1.0, warmup_steps=1, decay="poly", total_steps=5),
        dict(peak=1.0, warmup=1, decay="poly", total=5),
    ),
    "step": (
        dict(peak_lr=0.4, warmup_steps=2, decay="step", decay_boundaries=[5, 9],
             decay_rate=0.5, total_steps=12),
        dict(peak=0.4, warmup=2, decay="step", boundaries=(5, 9), rate=0.5),
    ),
    "step_at_warmup_end": (
        dict(peak_lr=0.4, warmup_steps=3, decay="step", decay_boundaries=[3]),
        dict(peak=0.4, warmup=3, decay="step", boundaries=(3,)),
    ),
}


def schedule_values(schedule, steps):
    return np.array([float(schedule(np.int64(s))) for s in steps])


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_match_reference(case):
    kwargs, reference = CASES[case]
    schedule = WarmupSchedule(**kwargs)
    steps = range(0, 26)
    expected = np.array([reference_lr(s, **reference) for s in steps])
    np.testing.assert_allclose(
        schedule_values(schedule, steps), expected, rtol=2e-6, atol=1e-8
    )


def test_values_worked_by_hand():
    constant = WarmupSchedule(0.8, warmup_steps=4)
    np.testing.assert_allclose(
        schedule_values(constant, range(6)), [0.2, 0.4, 0.6, 0.8, 0.8, 0.8], rtol=1e-6
    )
    # poly, power 1, from 1.0 to 0 between steps 2 and 6.
    poly = WarmupSchedule(1.0, warmup_steps=2, decay="poly", total_steps=6)
    np.testing.assert_allclose(
        schedule_values(poly, range(8)),
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0],
        rtol=1e-6, atol=1e-7,
    )
    # cosine from 1.0 to 0 over 4 steps: halfway is 0.5.
    cosine = WarmupSchedule(1.0, warmup_steps=1, decay="cosine", total_steps=5)
    np.testing.assert_allclose(
        schedule_values(cosine, [0, 1, 3, 5]), [1.0, 1.0, 0.5, 0.0], rtol=1e-6, atol=1e-7
    )
    # /10 from step 4 on (the boundary step itself is decayed).
    step = WarmupSchedule(1.0, decay="step", decay_boundaries=[4])
    np.testing.assert_allclose(
        schedule_values(step, [0, 3, 4, 5]), [1.0, 1.0, 0.1, 0.1], rtol=1e-6
    )


def test_first_step_is_not_zero():
    schedule = WarmupSchedule(1.0, warmup_steps=1000, decay="cosine", total_steps=5000)
    assert float(schedule(0)) == pytest.approx(1e-3, rel=1e-6)


def test_warmup_epochs_convert_to_steps():
    schedule = WarmupSchedule(1.0, warmup_epochs=2.5, steps_per_epoch=4)
    assert schedule.warmup_steps == 10
    assert schedule.get_config()["warmup_steps"] == 10
    np.testing.assert_allclose(
        schedule_values(schedule, [0, 9, 10]), [0.1, 1.0, 1.0], rtol=1e-6
    )


SCHEDULE_BAD_ARGUMENTS = [
    (dict(peak_lr=0.0), ValueError, r"`peak_lr` must be a finite number > 0"),
    (dict(peak_lr="1"), TypeError, r"`peak_lr`"),
    (dict(peak_lr=1.0, warmup_steps=-1), ValueError,
     r"`warmup_steps` must be an integer >= 0\. Received: warmup_steps=-1"),
    (dict(peak_lr=1.0, warmup_steps=2.5), TypeError, r"`warmup_steps` must be an integer"),
    (dict(peak_lr=1.0, decay="linear"), ValueError,
     r"`decay` must be one of 'constant', 'cosine', 'step', 'poly'\. "
     r"Received: decay='linear'"),
    (dict(peak_lr=1.0, decay="cosine"), ValueError, r"`total_steps` is required"),
    (dict(peak_lr=1.0, warmup_steps=10, decay="poly", total_steps=10), ValueError,
     r"`total_steps` must be greater than the warmup \(10 steps\)"),
    (dict(peak_lr=1.0, warmup_steps=50, total_steps=20), ValueError,
     r"Received: total_steps=20, warmup_steps=50"),
    (dict(peak_lr=1.0, decay="cosine", total_steps=10, end_lr=2.0), ValueError,
     r"`end_lr` must be a finite number in the range \[0.0, 1.0\]"),
    (dict(peak_lr=1.0, decay="poly", total_steps=10, power=0.0), ValueError, r"`power`"),
    (dict(peak_lr=1.0, decay="cosine", total_steps=10, power=2.0), ValueError,
     r"`power` is only used with decay in 'poly'"),
    (dict(peak_lr=1.0, end_lr=0.1), ValueError,
     r"`end_lr` is only used with decay in 'cosine', 'poly'.*decay='constant'"),
    (dict(peak_lr=1.0, decay_boundaries=[3]), ValueError, r"`decay_boundaries` is only"),
    (dict(peak_lr=1.0, decay="step"), ValueError,
     r"`decay_boundaries` must be a non-empty list"),
    (dict(peak_lr=1.0, decay="step", decay_boundaries=[]), ValueError, r"non-empty"),
    (dict(peak_lr=1.0, decay="step", decay_boundaries=[5, 5]), ValueError,
     r"strictly increasing"),
    (dict(peak_lr=1.0, warmup_steps=10, decay="step", decay_boundaries=[5]), ValueError,
     r"optimizer steps >= 10"),
    (dict(peak_lr=1.0, decay="step", decay_boundaries=[0]), ValueError, r">= 1"),
    (dict(peak_lr=1.0, decay="step", decay_boundaries=[30, 60], total_steps=40),
     ValueError, r"must be below `total_steps`"),
    (dict(peak_lr=1.0, decay="step", decay_boundaries=[5], decay_rate=0.0), ValueError,
     r"`decay_rate` must be a finite number in the range \(0.0, 1.0\]"),
    (dict(peak_lr=1.0, warmup_epochs=2), ValueError,
     r"`warmup_epochs` and `steps_per_epoch` go together"),
    (dict(peak_lr=1.0, warmup_epochs=2, steps_per_epoch=10, warmup_steps=5), ValueError,
     r"either `warmup_steps` or `warmup_epochs`"),
    (dict(peak_lr=1.0, warmup_epochs=-1, steps_per_epoch=10), ValueError, r"`warmup_epochs`"),
    (dict(peak_lr=1.0, warmup_epochs=1, steps_per_epoch=0), ValueError, r"`steps_per_epoch`"),
]


def test_rejects_bad_arguments():
    for kwargs, error, match in SCHEDULE_BAD_ARGUMENTS:
        with pytest.raises(error, match=match):
            WarmupSchedule(**kwargs)


# --------------------------------------------------------------------------
# Serialisation


@pytest.mark.parametrize("case", ["cosine", "poly", "step", "constant"])
def test_config_round_trip(case):
    schedule = WarmupSchedule(**CASES[case][0])
    config = schedule.get_config()
    restored = WarmupSchedule.from_config(config)
    assert restored.get_config() == config
    steps = range(0, 24, 3)
    np.testing.assert_array_equal(
        schedule_values(restored, steps), schedule_values(schedule, steps)
    )

    # Registered as "tfdp>WarmupSchedule": no custom_objects needed.
    serialized = keras.optimizers.schedules.serialize(schedule)
    assert serialized["registered_name"] == "tfdp>WarmupSchedule"
    restored = keras.optimizers.schedules.deserialize(serialized)
    assert isinstance(restored, WarmupSchedule) and restored.get_config() == config


def test_serialised_with_the_optimizer():
    schedule = WarmupSchedule(0.1, warmup_steps=10, decay="cosine", total_steps=100)
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    restored_schedule = restored._learning_rate
    assert isinstance(restored_schedule, WarmupSchedule)
    assert restored_schedule.get_config() == schedule.get_config()


# --------------------------------------------------------------------------
# In training


def test_fit_steps_are_optimizer_steps_under_mirrored_strategy():
    """Each optimizer step uses lr(iterations), whatever the replica count.

    With the per-example loss x @ w (averaged over the global batch by
    Keras) and x = 1, the gradient is 1, so plain SGD moves w by exactly
    -lr(s) at step s: w after n steps is -sum(lr(0..n-1)). (A loss that
    returns an already-averaged scalar would be summed over replicas.)
    """
    strategy = tfdp.make_strategy("mirrored", cpu_replicas=2)
    schedule = WarmupSchedule(0.8, warmup_steps=4, decay="poly", total_steps=8)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((1,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(schedule),
            loss=lambda y_true, y_pred: keras.ops.squeeze(y_pred, -1),
        )
    steps = 6
    x = np.ones((2 * steps, 1), "float32")
    model.fit(x, x, batch_size=2, epochs=1, shuffle=False, verbose=0)

    assert int(model.optimizer.iterations.numpy()) == steps
    lrs = [reference_lr(s, peak=0.8, warmup=4, decay="poly", total=8) for s in range(steps)]
    expected = -sum(lrs)
    np.testing.assert_allclose(model.get_weights()[0], [[expected]], rtol=1e-6)
    np.testing.assert_allclose(
        float(model.optimizer.learning_rate),
        reference_lr(steps, peak=0.8, warmup=4, decay="poly", total=8),
        rtol=1e-6,
    )
