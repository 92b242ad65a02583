"""Putting one of tfdp's callbacks first in whatever a user passed as `fit(callbacks=...)`.

`keras.Model.fit` takes its `callbacks` as a list, a tuple, nested lists, a
single `keras.callbacks.Callback`, or a ready `keras.callbacks.CallbackList`
(used as it is: Keras adds no History or progress bar to it). tfdp's `fit`
wrappers (`gc_freeze`, `sync_points`) put a callback of their own before the
user's, so that, e.g., a checkpoint callback sees synchronised weights; this
module does that for every one of those forms, and leaves the user's object
unchanged.
"""

from __future__ import annotations

import copy

import keras


def with_callback_first(first: keras.callbacks.Callback, callbacks):
    """`callbacks` (any form `Model.fit` takes, or None) with `first` before the rest.

    Returns a new list, or for a `CallbackList` a shallow copy of it holding
    `first` first (given the list's model and params, as its constructor
    gives its own callbacks).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        joined = copy.copy(callbacks)
        joined.callbacks = [first] + list(callbacks.callbacks)
        if getattr(callbacks, "model", None) is not None:
            first.set_model(callbacks.model)
        if getattr(callbacks, "params", None):
            first.set_params(callbacks.params)
        return joined
    return [first] + (keras.tree.flatten(callbacks) if callbacks else [])
