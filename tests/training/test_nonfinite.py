"""tfdp.training.nonfinite: every replica skips a NaN/Inf step alike, counts it, stops at the limit.

The optimizer wrappers are checked under a two-replica MirroredStrategy whose
all-reduces are counted at run time (`strategy_testing.counting_mirrored_strategy`):
one all-reduce per step, as without the wrapper, the same update as Keras'
own `apply`, and a NaN or Inf on either replica skipped by both. Then the fit
path (`tfdp.compile` + `model.fit`, with `BackupAndRestore`): a NaN batch
leaves the weights of a run that never saw it, too many in a row stop `fit`
with the fix, and no backup holds non-finite weights.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from strategy_testing import counting_mirrored_strategy
from tfdp.training import nonfinite
from tfdp._upstream import loss_scale
from tfdp.training.nonfinite import NonFiniteError, NonFiniteGuard, NonFiniteLossScaleOptimizer

# --- the optimizer wrappers, one variable, gradients given per replica -------------


def _apply_steps(strategy, optimizer, gradients_per_step, initial=(1.0, 1.0, 1.0)):
    """Applies one gradient per replica per step; returns every replica's weight."""
    with strategy.scope():
        weight = keras.Variable(np.asarray(initial, "float32"), name="w")
        optimizer = optimizer()
        optimizer.build([weight])

    @tf.function
    def step(gradients):
        strategy.run(lambda g: optimizer.apply_gradients([(g, weight)]), args=(gradients,))

    for per_replica in gradients_per_step:
        values = [tf.constant(g, tf.float32) for g in per_replica]
        step(strategy.experimental_distribute_values_from_function(
            lambda context, values=values: values[context.replica_id_in_sync_group]))
    return [v.numpy() for v in strategy.experimental_local_results(weight.value)], optimizer


GOOD = [[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]]


@pytest.mark.parametrize("make_inner", [
    lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    lambda: keras.optimizers.Adam(0.01),
])
def test_one_all_reduce_per_step_and_the_same_update_as_keras(make_inner):
    # Also tells when tfdp/_upstream/keras_optimizer_reduction.py no longer
    # turns Keras' own all-reduce off: the sum would be taken twice.
    steps = [GOOD, GOOD[::-1], GOOD]
    strategy, counter = counting_mirrored_strategy()
    want, keras_optimizer = _apply_steps(strategy, make_inner, steps)
    assert int(counter.numpy()) == len(steps)
    strategy, counter = counting_mirrored_strategy()
    got, guard = _apply_steps(strategy, lambda: NonFiniteGuard(make_inner()), steps)
    assert int(counter.numpy()) == len(steps)  # no extra collective
    for replica in got:
        np.testing.assert_allclose(replica, want[0], rtol=1e-6, atol=1e-7)
    assert int(guard.iterations.numpy()) == int(keras_optimizer.iterations.numpy()) == 3
    assert int(guard.skipped_steps.numpy()) == 0


@pytest.mark.parametrize("bad_replica", [0, 1])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_gradient_on_any_replica_is_skipped_by_every_replica(bad_replica, bad_value):
    bad = [list(g) for g in GOOD]
    bad[bad_replica][1] = bad_value
    strategy, counter = counting_mirrored_strategy()
    got, guard = _apply_steps(
        strategy, lambda: NonFiniteGuard(keras.optimizers.SGD(0.1, momentum=0.9)),
        [GOOD, bad, GOOD])
    strategy, _ = counting_mirrored_strategy()
    want, _ = _apply_steps(strategy, lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                           [GOOD, GOOD])
    assert int(counter.numpy()) == 3
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)  # as if never seen
    assert int(guard.iterations.numpy()) == 2  # the skipped step is no optimizer step
    assert int(guard.skipped_steps.numpy()) == 1
    assert int(guard.consecutive_skipped_steps.numpy()) == 0  # reset by the next step


def test_the_limit_freezes_the_optimizer_until_it_is_reset():
    nan = [[np.nan, 0.0, 0.0], [0.0, 0.0, 0.0]]
    strategy, _ = counting_mirrored_strategy()
    got, guard = _apply_steps(
        strategy, lambda: NonFiniteGuard(keras.optimizers.SGD(0.1), max_consecutive_nonfinite=2),
        [GOOD, nan, nan, GOOD, GOOD])
    strategy, _ = counting_mirrored_strategy()
    want, _ = _apply_steps(strategy, lambda: keras.optimizers.SGD(0.1), [GOOD])
    # Two in a row reach the limit: the finite steps after them are not applied.
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert [int(guard.skipped_steps.numpy()), int(guard.consecutive_skipped_steps.numpy()),
            int(guard.iterations.numpy())] == [2, 2, 1]


def test_loss_scaling_counts_toward_the_limit_only_skips_a_lower_scale_cannot_fix():
    nan = [[np.nan, 0.0, 0.0], [0.0, 0.0, 0.0]]
    strategy, counter = counting_mirrored_strategy()
    # Scaled gradients 4 * GOOD sum to 4 * (2, -1, 1.5); unscaled by 4 first.
    scaled_good = [[4 * v for v in g] for g in GOOD]
    got, optimizer = _apply_steps(
        strategy,
        lambda: NonFiniteLossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0,
                                            max_consecutive_nonfinite=2),
        [scaled_good, nan, nan])
    assert int(counter.numpy()) == 3  # the overflow decision costs no collective
    np.testing.assert_allclose(got[0], [1 - 0.1 * 2, 1 + 0.1 * 1, 1 - 0.1 * 1.5], rtol=1e-6)
    np.testing.assert_array_equal(got[0], got[1])
    # Scale 4 -> 2 -> 1: overflows while the scale adjusts, not "in a row".
    assert float(optimizer.dynamic_scale.numpy()) == 1.0
    assert [int(optimizer.skipped_steps.numpy()),
            int(optimizer.consecutive_skipped_steps.numpy()),
            int(optimizer.iterations.numpy())] == [2, 0, 1]

    strategy, _ = counting_mirrored_strategy()
    _, optimizer = _apply_steps(
        strategy,
        lambda: NonFiniteLossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0,
                                            max_consecutive_nonfinite=2),
        [nan, nan, nan])
    # At scale 1 and below they count; the third is after the limit.
    assert [int(optimizer.skipped_steps.numpy()),
            int(optimizer.consecutive_skipped_steps.numpy())] == [2, 2]
    assert float(optimizer.dynamic_scale.numpy()) == 0.25
    assert isinstance(optimizer, loss_scale.LossScaleOptimizer)


def test_fold_loss_into_gradients_changes_nothing_unless_the_loss_is_not_finite():
    big = tf.Variable([1.0, 2.0, 3.0])
    small = tf.Variable([0.5])
    x = tf.constant([1.0, -1.0, 2.0])

    def gradients(offset, fold):
        with tf.GradientTape() as tape:
            # `offset` does not depend on the weights: its NaN alone would
            # leave the gradients finite.
            loss = tf.reduce_sum(big * x) + 3.0 * small[0] + offset
        grads = tape.gradient(loss, [big, small])
        if fold:
            grads = nonfinite.fold_loss_into_gradients(loss, grads)
        return [g.numpy() for g in grads]

    np.testing.assert_array_equal(gradients(0.0, True)[0], gradients(0.0, False)[0])
    np.testing.assert_array_equal(gradients(0.0, True)[1], gradients(0.0, False)[1])
    assert all(np.isfinite(g).all() for g in gradients(np.nan, False))
    folded = gradients(np.nan, True)
    assert np.isfinite(folded[0]).all() and np.isnan(folded[1]).all()  # the smallest
    # A variable without a gradient keeps None (the optimizer leaves it alone).
    unused = tf.Variable([7.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(big * x) + np.nan
    grads = nonfinite.fold_loss_into_gradients(loss, tape.gradient(loss, [unused, big]))
    assert grads[0] is None and np.isnan(grads[1].numpy()).all()


def test_wrappers_serialize_and_checkpoint_their_counts(tmp_path):
    for optimizer in (
        NonFiniteGuard(keras.optimizers.Adam(0.01), max_consecutive_nonfinite=4),
        NonFiniteLossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0,
                                    max_consecutive_nonfinite=4),
    ):
        copy = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        assert type(copy) is type(optimizer)
        assert type(copy.inner_optimizer) is type(optimizer.inner_optimizer)
        assert copy.max_consecutive_nonfinite == 4

        weight = keras.Variable([1.0, 2.0])
        optimizer.build([weight])
        optimizer.skipped_steps.assign(7)
        optimizer.consecutive_skipped_steps.assign(2)
        path = tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / type(copy).__name__))
        copy.build([keras.Variable([0.0, 0.0])])
        tf.train.Checkpoint(optimizer=copy).read(path).assert_existing_objects_matched()
        assert (int(copy.skipped_steps.numpy()), int(copy.consecutive_skipped_steps.numpy())) == (7, 2)


def test_wrap_optimizer_picks_the_wrapper():
    sgd = keras.optimizers.SGD(0.1)
    assert nonfinite.wrap_optimizer(sgd, nonfinite=None) is sgd
    guard = nonfinite.wrap_optimizer(sgd, nonfinite="skip", max_consecutive_nonfinite=3)
    assert isinstance(guard, NonFiniteGuard) and guard.inner_optimizer is sgd
    assert guard.max_consecutive_nonfinite == 3
    assert nonfinite.wrap_optimizer(guard, nonfinite="skip") is guard
    assert nonfinite.wrap_optimizer("adam", nonfinite="raise").max_consecutive_nonfinite == 1
    keras_scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    scaled = nonfinite.wrap_optimizer(keras_scaled, nonfinite="skip")
    assert isinstance(scaled, NonFiniteLossScaleOptimizer) and scaled.initial_scale == 64.0
    # Under loss scaling, nonfinite=None takes the same decision path, without a limit.
    unlimited = nonfinite.wrap_optimizer(keras_scaled, nonfinite=None)
    assert isinstance(unlimited, NonFiniteLossScaleOptimizer) and unlimited.initial_scale == 64.0
    assert unlimited.max_consecutive_nonfinite == nonfinite.NO_LIMIT
    assert isinstance(unlimited, loss_scale.LossScaleOptimizer)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        NonFiniteGuard(keras.optimizers.SGD(gradient_accumulation_steps=2))


# --- the fit path: tfdp.compile + model.fit -------------------------------------------

FEATURES, CLASSES, GLOBAL_BATCH, STEPS = 5, 3, 8, 6
NAN_BATCH, NAN_EXAMPLE = 2, GLOBAL_BATCH - 1  # the second replica's half


def _batches(nan_batches=(), drop=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(STEPS * GLOBAL_BATCH,)).astype("int32")
    for b in nan_batches:
        x[b * GLOBAL_BATCH + NAN_EXAMPLE, 2] = np.nan
    if drop is not None:
        keep = np.ones(len(x), bool)
        keep[drop * GLOBAL_BATCH:(drop + 1) * GLOBAL_BATCH] = False
        x, y = x[keep], y[keep]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)


def _compiled(strategy, **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(CLASSES)])
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.3, momentum=0.5),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps, steps_per_execution", [(1, 1), (2, 2)])
def test_fit_skips_a_nan_batch_on_one_replica_like_a_run_without_it(accum_steps,
                                                                      steps_per_execution):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    kwargs = dict(accum_steps=accum_steps, steps_per_execution=steps_per_execution)
    never_saw = _compiled(strategy, **kwargs)
    never_saw.fit(_batches(drop=NAN_BATCH), epochs=1, verbose=0)
    model = _compiled(strategy, **kwargs)
    assert isinstance(model.optimizer, NonFiniteGuard)
    history = model.fit(_batches(nan_batches=[NAN_BATCH]), epochs=1, verbose=0)
    assert int(model.optimizer.skipped_steps.numpy()) == 1
    assert int(model.optimizer.iterations.numpy()) == STEPS - 1
    assert np.isnan(history.history["loss"][0])  # Keras averages the skipped step's loss in
    for variable, want in zip(model.trainable_weights, never_saw.trainable_weights):
        replicas = [v.numpy() for v in strategy.experimental_local_results(variable.value)]
        np.testing.assert_array_equal(replicas[0], replicas[1])
        np.testing.assert_allclose(replicas[0], want.numpy(), atol=1e-6, rtol=0)


def _assert_checkpoints_finite(directory: Path):
    paths = sorted({str(p)[: -len(".index")] for p in directory.glob("ckpt-*.index")})
    assert paths
    for path in paths:
        for name, _ in tf.train.list_variables(path):
            value = np.asarray(tf.train.load_variable(path, name))
            if value.dtype.kind == "f":
                assert np.isfinite(value).all(), (path, name)


@pytest.mark.slow
def test_fit_stops_after_the_limit_and_backups_stay_finite(tmp_path):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    good = _compiled(strategy)
    good.fit(_batches().take(2), epochs=1, verbose=0)
    model = _compiled(strategy, max_consecutive_nonfinite=2)
    backup = tfdp.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=1)
    with pytest.raises(NonFiniteError) as error:
        model.fit(backup.wrap(lambda epoch: _batches(nan_batches=[2, 3, 4])), epochs=1,
                  verbose=0, callbacks=[backup])
    message = str(error.value)
    assert message.startswith("tfdp fit: 2 training steps in a row (steps 3-4,")
    assert "The weights are those after step 2" in message and "Lower the learning rate" in message
    assert int(model.optimizer.iterations.numpy()) == 2
    for got, want in zip(model.get_weights(), good.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    _assert_checkpoints_finite(tmp_path / "backup")


@pytest.mark.slow
def test_fit_without_handling_never_backs_up_non_finite_weights(tmp_path):
    model = _compiled(tfdp.make_strategy(cpu_replicas=2), nonfinite=None)
    assert not isinstance(model.optimizer, nonfinite.NonFiniteGuard)
    backup = tfdp.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=1)
    with pytest.raises(NonFiniteError, match=r"tfdp BackupAndRestore: not saving the checkpoint "
                                             r"of step 3: .*the newest checkpoint is still"):
        model.fit(backup.wrap(lambda epoch: _batches(nan_batches=[NAN_BATCH])), epochs=1,
                  verbose=0, callbacks=[backup])
    _assert_checkpoints_finite(tmp_path / "backup")


@pytest.mark.slow
def test_fit_under_mixed_float16_skips_and_counts():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        strategy = tfdp.make_strategy(cpu_replicas=2)
        model = _compiled(strategy, accum_steps=2)
        assert isinstance(model.optimizer, NonFiniteLossScaleOptimizer)
        model.fit(_batches(nan_batches=[NAN_BATCH]), epochs=1, verbose=0)
        assert int(model.optimizer.skipped_steps.numpy()) == 1
        assert int(model.optimizer.iterations.numpy()) == STEPS - 1
        assert all(np.isfinite(w).all() for w in model.get_weights())
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("kwargs, match", [
    (dict(nonfinite="warn"), r"`nonfinite` must be 'skip'"),
    (dict(max_consecutive_nonfinite=-1), r"`max_consecutive_nonfinite` must be a positive"),
])
def test_compile_refuses_invalid_nonfinite_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _compiled(tfdp.make_strategy("default"), **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip", None])
def test_mixed_float16_decides_from_the_reduced_gradients_in_every_mode(mode):
    # One path owns the decision under loss scaling: the scaled gradients are
    # all-reduced once (no separate flag all-reduce), checked summed, then
    # unscaled; with nonfinite=None too, whose skips are counted so that
    # iterations + skipped_steps stays the steps taken (what resuming reads).
    keras.config.set_dtype_policy("mixed_float16")
    try:
        strategy, counter = counting_mirrored_strategy()
        model = _compiled(strategy, nonfinite=mode)
        assert isinstance(model.optimizer, NonFiniteLossScaleOptimizer)
        model.fit(_batches(), epochs=1, verbose=0)
        per_step = int(counter.numpy()) / STEPS
        counter.assign(0)
        model.fit(_batches(nan_batches=[NAN_BATCH]), epochs=1, verbose=0)
        assert int(counter.numpy()) / STEPS == per_step
        assert int(model.optimizer.skipped_steps.numpy()) == 1
        assert int(model.optimizer.iterations.numpy()) == 2 * STEPS - 1
        assert all(np.isfinite(w).all() for w in model.get_weights())
    finally:
        keras.config.set_dtype_policy("float32")
