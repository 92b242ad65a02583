"""Canary for `tfdp._upstream.keras_optimizer_internals`: the Keras optimizer members tfdp reads.

Each test checks one member against a real Keras optimizer: it fails when
Keras renames or repurposes it, pointing at the accessor to update.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp._upstream import keras_optimizer_internals as internals


def _variables():
    return [keras.Variable(np.ones((2, 3), "float32"), name="a"),
            keras.Variable(np.zeros((3,), "float32"), name="b")]


def test_the_installed_keras_is_one_these_members_were_read_from():
    assert internals.is_supported(), (
        f"Keras {keras.__version__} is outside {internals.KNOWN_KERAS_RANGE}: check every "
        f"member in tfdp/_upstream/keras_optimizer_internals.py, then widen the range.")
    assert not internals.is_supported("4.0.0")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        internals.is_supported("three")


def test_variable_index_is_the_position_in_the_built_list():
    variables = _variables()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(variables)
    assert [internals.variable_index(optimizer, v) for v in variables] == [0, 1]
    assert internals.built_variables(optimizer) == variables


def test_lamb_moments_are_the_slots_lamb_updates():
    variables = _variables()
    optimizer = keras.optimizers.Lamb(0.1)
    optimizer.build(variables)
    m, v = internals.lamb_moments(optimizer, 1)
    assert tuple(m.shape) == tuple(v.shape) == (3,)
    optimizer.apply([tf.ones((2, 3)), tf.fill((3,), 2.0)], variables)
    # Keras' Lamb moved exactly these: m = (1 - beta_1) g, v = (1 - beta_2) g^2.
    np.testing.assert_allclose(m.numpy(), 0.1 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(v.numpy(), 0.001 * 4.0, rtol=1e-5)


def test_own_variables_are_the_optimizers_not_the_models():
    variables = _variables()
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build(variables)
    own = internals.own_variables(optimizer)
    assert optimizer.iterations in own
    assert not any(v is w for v in own for w in variables)
    assert len(own) == len(optimizer.variables)


def test_no_merge_call_switch_answers_under_each_strategy():
    assert internals.supports_no_merge_call() in (True, False)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        assert internals.supports_no_merge_call() in (True, False)


def test_a_missing_member_names_this_file():
    with pytest.raises(RuntimeError, match="tfdp/_upstream/keras_optimizer_internals.py"):
        internals.variable_index(object(), None)
