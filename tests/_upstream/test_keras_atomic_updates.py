"""Canary for `tfdp._upstream.keras_atomic_updates`: Keras' `assign_add` is still read-then-write.

When the source check fails, Keras changed `Variable.assign_add`: see whether
it is now atomic (one `AssignAddVariableOp`) and, if so, drop the patch. The
patch itself is exercised end to end by
`tests/training/test_parameter_server_training.py` (without it, 2 workers
counted 38 of 44 steps in `optimizer.iterations`).
"""

import inspect

import keras
import numpy as np
import tensorflow as tf

from tfdp._upstream import keras_atomic_updates


def test_keras_assign_add_is_a_read_then_a_write():
    from keras.src.backend.common import variables

    assert "self.assign(self + value)" in inspect.getsource(variables.Variable.assign_add)
    assert "self.assign(self - value)" in inspect.getsource(variables.Variable.assign_sub)
    from keras.src.backend.tensorflow import core

    # The TensorFlow backend does not override them (before the patch).
    assert "assign_add" not in vars(core.Variable) or keras_atomic_updates.is_applied()


def test_the_installed_keras_is_in_the_known_range():
    assert keras_atomic_updates._versions.keras_in_range(keras_atomic_updates.KNOWN_KERAS_RANGE)


def test_the_patch_changes_nothing_outside_parameter_servers():
    keras_atomic_updates.apply()
    assert keras_atomic_updates.is_applied()
    variable = keras.Variable(np.array([1.0, 2.0], "float32"))
    np.testing.assert_array_equal(variable.assign_add([1.0, 1.0]), [2.0, 3.0])
    np.testing.assert_array_equal(variable.assign_sub([0.5, 0.5]), [1.5, 2.5])
    counter = keras.Variable(0, dtype="int64")

    @tf.function
    def count():
        for _ in tf.range(5):
            counter.assign_add(1)

    count()
    assert int(counter.numpy()) == 5
