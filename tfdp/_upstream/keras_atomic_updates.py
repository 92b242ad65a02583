"""Keras 3 variables' `assign_add`/`assign_sub` made atomic under `ParameterServerStrategy`.

Keras 3.15's `Variable.assign_add(value)` is `self.assign(self + value)`
(`keras/src/backend/common/variables.py`; the TensorFlow backend's
`keras/src/backend/tensorflow/core.py::Variable` does not override it): a
read, then a write. Under `ParameterServerStrategy` several workers update
the same variable on a ps task at once, and an increment read between
another worker's read and write is lost. Seen here with 2 workers: after a
round of 44 scheduled steps the optimizer's `iterations` (Keras' own
`self._iterations.assign_add(1)`) counted 38; a Keras metric's totals lose
updates the same way. TensorFlow's own `tf.Variable.assign_add` is one
`AssignAddVariableOp`, which holds the variable's lock across the read and the
write. (The optimizer's updates of weights and slots are not affected: the
TensorFlow backend's optimizer calls the `tf.Variable` op directly,
`keras/src/backend/tensorflow/optimizer.py::TFOptimizer.assign_add`.)

`apply()` makes Keras' `assign_add`/`assign_sub` call the `tf.Variable` op
when the current strategy is a `ParameterServerStrategy` (inside the
functions `ClusterCoordinator.schedule` traces, which it traces in the
strategy's scope), and leaves every other strategy on Keras' own code.
`tests/_upstream/test_keras_atomic_updates.py` is the canary: it fails when
Keras' `assign_add` is no longer the read-then-write above.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp._upstream import _versions

#: Keras (major, minor) versions whose `Variable.assign_add` is read-then-write.
KNOWN_KERAS_RANGE = ((3, 0), (3, 15))

_APPLIED = False


def _variable_class():
    from keras.src.backend.tensorflow import core  # pylint: disable=import-outside-toplevel

    return core.Variable


def _on_parameter_servers() -> bool:
    return isinstance(tf.distribute.get_strategy(),
                      tf.distribute.experimental.ParameterServerStrategy)


def _atomic(keras_method, tf_method_name: str):
    def update(self, value):
        from keras.src.backend.common.stateless_scope import in_stateless_scope  # pylint: disable=import-outside-toplevel

        if in_stateless_scope() or not _on_parameter_servers():
            return keras_method(self, value)
        value = tf.cast(self._convert_to_tensor(value, dtype=self.dtype), self._value.dtype)
        return getattr(self._value, tf_method_name)(value)

    update.__name__ = keras_method.__name__
    update.__doc__ = keras_method.__doc__
    update._tfdp_atomic = True
    return update


def apply() -> bool:
    """Makes Keras variables' `assign_add`/`assign_sub` atomic under ParameterServerStrategy.

    Idempotent. Returns whether the patch is in place (False, with nothing
    changed, for a Keras outside `KNOWN_KERAS_RANGE`, whose code was not read).
    """
    global _APPLIED
    if _APPLIED:
        return True
    if not _versions.keras_in_range(KNOWN_KERAS_RANGE):
        return False
    variable = _variable_class()
    variable.assign_add = _atomic(variable.assign_add, "assign_add")
    variable.assign_sub = _atomic(variable.assign_sub, "assign_sub")
    _APPLIED = True
    return True


def is_applied() -> bool:
    """Whether `apply()` has patched Keras' variables in this process."""
    return bool(getattr(_variable_class().assign_add, "_tfdp_atomic", False))

