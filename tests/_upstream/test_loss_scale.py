"""Loss scaling under MirroredStrategy: every replica skips an overflowing step.

Keras' `LossScaleOptimizer` decides from the first replica's local gradients;
tfdp's all-reduces the decision (tfdp/_upstream/loss_scale.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import Trainer
from tfdp._upstream import loss_scale


@pytest.fixture(scope="module")
def strategy():
    return tfdp.make_strategy(cpu_replicas=2)


def _apply_with_overflow_on(strategy, optimizer_class, bad_replica):
    """One step where replica `bad_replica`'s gradient holds an inf."""
    with strategy.scope():
        weight = keras.Variable(np.ones((3,), "float32"), name="w")
        optimizer = optimizer_class(keras.optimizers.SGD(0.1), initial_scale=8.0)
        optimizer.build([weight])

    def gradient(context):
        if context.replica_id_in_sync_group == bad_replica:
            return tf.constant([np.inf, 1.0, 1.0])
        return tf.constant([1.0, 1.0, 1.0])

    @tf.function
    def step(gradients):
        strategy.run(lambda g: optimizer.apply_gradients([(g, weight)]), args=(gradients,))

    step(strategy.experimental_distribute_values_from_function(gradient))
    weights = [w.numpy() for w in strategy.experimental_local_results(weight.value)]
    return weights, int(optimizer.iterations.numpy()), float(optimizer.dynamic_scale.numpy())


def test_upstream_applies_an_overflow_from_the_second_replica(strategy):
    # When this fails, Keras decides over all replicas: drop tfdp's subclass.
    weights, iterations, _ = _apply_with_overflow_on(
        strategy, keras.optimizers.LossScaleOptimizer, bad_replica=1
    )
    assert iterations == 1 and not np.isfinite(weights[0][0])


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_every_replica_skips_an_overflow_on_any_replica(strategy, bad_replica):
    weights, iterations, scale = _apply_with_overflow_on(
        strategy, loss_scale.LossScaleOptimizer, bad_replica=bad_replica
    )
    for replica_weights in weights:
        np.testing.assert_array_equal(replica_weights, np.ones(3, "float32"))
    assert (iterations, scale) == (0, 4.0)  # skipped, and the scale halved


def test_finite_gradients_are_applied_once_all_reduced(strategy):
    weights, iterations, scale = _apply_with_overflow_on(
        strategy, loss_scale.LossScaleOptimizer, bad_replica=-1
    )
    # Sum over 2 replicas of a gradient of 1 (unscaled by 8 from 8), lr 0.1.
    for replica_weights in weights:
        np.testing.assert_allclose(replica_weights, np.full(3, 1 - 0.1 * 2 / 8, "float32"))
    assert (iterations, scale) == (1, 8.0)


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy("float32")


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


def test_compile_and_trainer_use_the_consistent_optimizer(strategy, mixed_float16):
    with strategy.scope():
        model = _model()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse", accum_steps=2)
        keras_wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                            initial_scale=64.0)
        trainer_model = _model()
        trainer = Trainer(trainer_model, optimizer=keras_wrapped, loss="mse",
                          strategy=strategy, batch=tfdp.BatchConfig(2, 2))
    assert isinstance(model.optimizer, loss_scale.LossScaleOptimizer)
    assert isinstance(trainer.optimizer, loss_scale.LossScaleOptimizer)
    assert trainer.optimizer.initial_scale == 64.0
    config = keras.optimizers.serialize(model.optimizer)
    assert isinstance(keras.optimizers.deserialize(config), loss_scale.LossScaleOptimizer)
