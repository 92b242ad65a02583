"""The Keras 3 optimizer internals tfdp's optimizers and wrappers read.

Keras 3's public optimizer API has no way to ask which slot belongs to a
variable, which variables an optimizer was built for, or which variables a
wrapper created itself; every Keras optimizer reads its own private members
for these (`keras/src/optimizers/sgd.py` calls `self._get_variable_index`,
`keras/src/optimizers/lamb.py` keeps `self._momentums`/`self._velocities`).
tfdp needs the same in three places:

- `tfdp.optimizers.LARS` and `LAMB`: the slot index of a variable
  (`variable_index`), and LAMB's moments as Keras' `Lamb.build` creates them
  (`lamb_moments`);
- tfdp's non-finite optimizer wrappers (`tfdp.training.nonfinite`): the
  variables an optimizer was built for (`built_variables`), the wrapper's own
  counters without the inner optimizer's (`own_variables`), and whether the
  current strategy updates without a `merge_call` (`supports_no_merge_call`,
  TensorFlow's `tf.__internal__` switch that Keras' own optimizer reads).

Each accessor raises a `RuntimeError` naming this file when the member is
gone, instead of an `AttributeError` deep in a traced step.
`tests/_upstream/test_keras_optimizer_internals.py` is the canary: it checks
every member against a real Keras optimizer, and the installed Keras against
`KNOWN_KERAS_RANGE`.
"""

from __future__ import annotations


import keras
import tensorflow as tf

from tfdp._upstream import _versions

# pylint: disable=protected-access

#: Keras (major, minor) versions these members were read from, inclusive.
KNOWN_KERAS_RANGE = ((3, 0), (3, 15))


def is_supported(keras_version: str | None = None) -> bool:
    """Whether `keras_version` (default: the installed one) is in `KNOWN_KERAS_RANGE`."""
    return _versions.keras_in_range(KNOWN_KERAS_RANGE, keras_version)


def _member(owner, name: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise RuntimeError(
            f"{type(owner).__name__} has no {name}: Keras {keras.__version__} changed the "
            f"optimizer internals tfdp reads (written for Keras "
            f"{KNOWN_KERAS_RANGE[0][0]}.{KNOWN_KERAS_RANGE[0][1]} to "
            f"{KNOWN_KERAS_RANGE[1][0]}.{KNOWN_KERAS_RANGE[1][1]}). Update "
            f"tfdp/_upstream/keras_optimizer_internals.py."
        ) from None


def variable_index(optimizer: keras.optimizers.Optimizer, variable) -> int:
    """The index of `variable`'s slots in the lists `add_optimizer_variables` returned."""
    return _member(optimizer, "_get_variable_index")(variable)


def lamb_moments(optimizer: keras.optimizers.Lamb, index: int):
    """`(m, v)`: the first and second moment of variable `index`, as `Lamb.build` made them."""
    return _member(optimizer, "_momentums")[index], _member(optimizer, "_velocities")[index]


def built_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The trainable variables `optimizer` was built for, in build order."""
    return list(_member(optimizer, "_trainable_variables"))


def own_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables `optimizer` created itself (not those of optimizers it wraps)."""
    return list(_member(optimizer, "_variables"))


def supports_no_merge_call() -> bool:
    """Whether the current strategy can update variables in replica context, without `merge_call`."""
    return bool(_member(tf.__internal__.distribute, "strategy_supports_no_merge_call")())
