"""tfdp.distribute.reduction: gradients summed over replicas in their dtype, or in bfloat16.

Checked under a two-replica MirroredStrategy over logical CPUs: a value that
bfloat16 cannot hold comes back rounded (so the all-reduce really ran in
bfloat16) and in float32; Inf and NaN survive the round trip (so the
non-finite guard still skips); the optimizer wrappers, `tfdp.compile` and
`tfdp.Trainer` pass the dtype through; training with it stays within
bfloat16's rounding of float32 training.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import nonfinite
from tfdp.distribute import reduction
from strategy_testing import counting_mirrored_strategy

# 1 + 2**-10 needs 11 significant bits; bfloat16 has 8, so it rounds to 1.
NOT_IN_BFLOAT16 = 1.0 + 2.0**-10


def _sum_over_two_replicas(per_replica_values, all_reduce_dtype):
    """Each replica's gradients (lists of float32 arrays) summed by `all_reduce_sum`."""
    strategy = tfdp.make_strategy(cpu_replicas=2)

    def replica_fn():
        context = tf.distribute.get_replica_context()
        index = context.replica_id_in_sync_group
        # One gradient per variable: this replica's row of the stacked values.
        gradients = [
            None if values[0] is None else tf.constant(np.stack(values))[index]
            for values in zip(*per_replica_values)
        ]
        return reduction.all_reduce_sum(context, gradients, all_reduce_dtype)

    summed = strategy.run(replica_fn)
    return [None if s is None else strategy.experimental_local_results(s)[0] for s in summed]


def test_bfloat16_sums_are_rounded_and_come_back_in_float32():
    replica_0 = [np.full([3], NOT_IN_BFLOAT16, "float32"), None, np.array([0.25], "float32")]
    replica_1 = [np.full([3], 1.0, "float32"), None, np.array([0.5], "float32")]
    exact = _sum_over_two_replicas([replica_0, replica_1], None)
    compressed = _sum_over_two_replicas([replica_0, replica_1], "bfloat16")
    assert exact[0].dtype == compressed[0].dtype == tf.float32
    np.testing.assert_array_equal(exact[0].numpy(), [2.0 + 2.0**-10] * 3)
    np.testing.assert_array_equal(compressed[0].numpy(), [2.0] * 3)  # rounded: bfloat16
    assert exact[1] is None and compressed[1] is None
    np.testing.assert_array_equal(compressed[2].numpy(), [0.75])  # representable: exact


def test_exact_tensors_ride_in_the_same_all_reduce_in_their_own_dtype():
    """`exact=` (e.g. a count) is summed in float32 even when the gradients go in bfloat16."""
    strategy, counter = counting_mirrored_strategy()

    def replica_fn():
        context = tf.distribute.get_replica_context()
        index = tf.cast(context.replica_id_in_sync_group, tf.float32)
        gradients = [tf.fill([3], NOT_IN_BFLOAT16)]
        count = tf.reshape(NOT_IN_BFLOAT16 + index, [1])  # 1 + 2**-10, then 2 + 2**-10
        return reduction.all_reduce_sum(context, gradients, "bfloat16", exact=[count])

    (gradient,), (count,) = strategy.run(replica_fn)
    np.testing.assert_array_equal(strategy.experimental_local_results(gradient)[0].numpy(),
                                  [2.0] * 3)
    np.testing.assert_array_equal(strategy.experimental_local_results(count)[0].numpy(),
                                  [3.0 + 2.0**-9])
    assert int(counter.numpy()) == 1


def test_inf_and_nan_survive_the_bfloat16_round_trip():
    replica_0 = [np.array([np.inf, 1.0, np.nan], "float32")]
    replica_1 = [np.array([1.0, 1.0, 1.0], "float32")]
    (summed,) = _sum_over_two_replicas([replica_0, replica_1], "bfloat16")
    value = summed.numpy()
    assert np.isposinf(value[0]) and value[1] == 2.0 and np.isnan(value[2])


def test_the_guard_sums_in_bfloat16_with_one_all_reduce_and_skips_non_finite_steps():
    strategy, counter = counting_mirrored_strategy()
    with strategy.scope():
        weight = keras.Variable(np.zeros([2], "float32"), name="w")
        guard = nonfinite.wrap_optimizer(keras.optimizers.SGD(1.0), nonfinite="skip",
                                         all_reduce_dtype="bfloat16")
        guard.build([weight])

    @tf.function
    def step(per_replica):
        strategy.run(lambda g: guard.apply_gradients([(g, weight)]), args=(per_replica,))

    def gradients(replica_0, replica_1):
        values = [tf.constant(replica_0, tf.float32), tf.constant(replica_1, tf.float32)]
        return strategy.experimental_distribute_values_from_function(
            lambda context: values[context.replica_id_in_sync_group])

    step(gradients([NOT_IN_BFLOAT16, 0.5], [1.0, 0.5]))
    assert int(counter.numpy()) == 1
    for local in strategy.experimental_local_results(weight.value):
        np.testing.assert_array_equal(local.numpy(), [-2.0, -1.0])  # not -2.0009765625
    step(gradients([np.inf, 0.5], [1.0, 0.5]))
    assert int(guard.skipped_steps.numpy()) == 1
    for local in strategy.experimental_local_results(weight.value):
        np.testing.assert_array_equal(local.numpy(), [-2.0, -1.0])


def test_the_dtype_is_saved_with_the_optimizer_config():
    guard = nonfinite.NonFiniteGuard(keras.optimizers.SGD(0.1), all_reduce_dtype="bfloat16")
    assert nonfinite.NonFiniteGuard.from_config(guard.get_config()).all_reduce_dtype == "bfloat16"
    scaled = nonfinite.NonFiniteLossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                   all_reduce_dtype="bfloat16")
    assert type(scaled).from_config(scaled.get_config()).all_reduce_dtype == "bfloat16"


@pytest.mark.parametrize("kwargs, message", [
    (dict(all_reduce_dtype="float16"), "`all_reduce_dtype` must be None .* 'bfloat16'"),
    (dict(all_reduce_dtype="bfloat16", nonfinite=None), "nonfinite='skip'"),
])
def test_bad_all_reduce_dtype_is_refused_by_compile_and_trainer(kwargs, message):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=message):
        tfdp.compile(model, optimizer=optimizer, loss="mse", **kwargs)
    with pytest.raises(ValueError, match=message):
        tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                     batch=tfdp.BatchConfig(4, 2), **kwargs)


def _train(all_reduce_dtype, *, trainer: bool):
    keras.utils.set_random_seed(0)
    strategy = tfdp.make_strategy(cpu_replicas=2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    if trainer:
        loop = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                            batch=tfdp.BatchConfig.from_global(16, 2),
                            all_reduce_dtype=all_reduce_dtype)
        assert loop.optimizer.all_reduce_dtype == all_reduce_dtype
        loop.train(dataset.repeat(), steps=12)
    else:
        with strategy.scope():
            tfdp.compile(model, optimizer=optimizer, loss="mse", all_reduce_dtype=all_reduce_dtype)
        assert model.optimizer.all_reduce_dtype == all_reduce_dtype
        model.fit(dataset, epochs=3, verbose=0)
    return [w.numpy() for w in model.weights]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [False, True], ids=["fit", "trainer"])
def test_training_with_bfloat16_all_reduce_stays_close_to_float32(trainer):
    exact = _train(None, trainer=trainer)
    compressed = _train("bfloat16", trainer=trainer)
    differences = [np.max(np.abs(a - b)) for a, b in zip(exact, compressed)]
    assert max(differences) > 0.0  # the reduction really changed
    for a, b in zip(exact, compressed):
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
