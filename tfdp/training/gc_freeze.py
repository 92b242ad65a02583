"""Keeping Python's full garbage collections from stalling every worker while a model trains.

CPython's cyclic collector now and then runs a full (generation 2)
collection, which walks every container object the process tracks. Once
Keras has built a model and TensorFlow has traced its train and test
functions, that is hundreds of thousands of objects (graphs, ops, tensors,
autograph caches): a full collection of the digits CNN's worker took
110-260 ms, the longer ones after tracing (Zen 5 EPYC, Python 3.11,
2026-11-26; `python -m tfdp.bench.time_to_accuracy`), against a steady
epoch of 0.23 s. On one process that is a pause. In synchronous data
parallelism each worker pauses at its own moment and the others wait for
it at the next collective, so every worker's pause stalls the whole job:
with N workers, N pauses.

`FrozenHeap` moves the objects that exist when training starts, and again
those built by the first trace of each function, into the collector's
permanent generation (`gc.freeze`), which collections skip; at the end of
training it gives them back (`gc.unfreeze`). Collections keep running
during training, but only over the objects made since, so a full one costs
a few milliseconds. The objects are not kept alive by this: reference
counting frees them as always. Only garbage *cycles* among frozen objects
wait for the end of training to be collected, and those were made before
training or by tracing, not per step.

A process that manages its collector itself is left alone: when automatic
collection is disabled (`gc.disable()`) or something is frozen already
(`gc.freeze()` before forking, say) when training starts, `FrozenHeap`
does nothing at all.

`FreezeHeapDuringFit` is the Keras callback `tfdp.compile` puts first in
every `model.fit`; its `evaluate` and `predict` run inside a `FrozenHeap`
(`call_with_frozen_heap`; within `fit` the heap is frozen already, so
validation changes nothing); `tfdp.Trainer.train` uses `FrozenHeap` itself.
"""

from __future__ import annotations

import gc
import inspect

import keras

from tfdp.training.callback_order import with_callback_first


#: The `keras.Model` methods `tfdp.compile` runs inside a `FrozenHeap` as a whole.
CALL_METHODS = ("evaluate", "predict")
#: Every `keras.Model` method `tfdp.compile` shadows for this module.
METHODS = ("fit",) + CALL_METHODS


class FrozenHeap:
    """`gc.freeze` when training starts and after each first trace; `gc.unfreeze` at its end.

    Usable as a context manager (`with FrozenHeap() as heap: ...`) or with
    `start` / `stop`. Not thread-safe: one training loop owns it.
    """

    def __init__(self):
        self.active = False
        self._marked: set = set()

    def start(self) -> None:
        """Freezes the heap, unless the process manages its collector itself."""
        self._marked = set()
        self.active = gc.isenabled() and gc.get_freeze_count() == 0
        if self.active:
            gc.freeze()

    def mark(self, what: str) -> None:
        """Freezes what the first run of `what` (e.g. `"train"`) built; later calls do nothing."""
        if self.active and what not in self._marked:
            self._marked.add(what)
            gc.freeze()

    def stop(self) -> None:
        """Gives the frozen objects back to the collector (the oldest generation)."""
        if self.active:
            self.active = False
            gc.unfreeze()

    def __enter__(self) -> "FrozenHeap":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class FreezeHeapDuringFit(keras.callbacks.Callback):
    """`FrozenHeap` over one `model.fit`: frozen at its start, after the first train
    call and after the first evaluation; unfrozen at its end.

    `fit` calls `on_train_end` only when it returns; `tfdp.compile`'s `fit`
    also unfreezes when it raises (`fit_with_frozen_heap`).
    """

    def __init__(self):
        super().__init__()
        self.heap = FrozenHeap()

    def on_train_begin(self, logs=None):
        self.heap.start()

    def on_train_batch_end(self, batch, logs=None):
        self.heap.mark("train")

    def on_test_end(self, logs=None):
        self.heap.mark("test")

    def on_train_end(self, logs=None):
        self.heap.stop()


#: `Model.fit`'s parameters after `self`, in order (for positional arguments).
_FIT_PARAMETERS = tuple(inspect.signature(keras.Model.fit).parameters)[1:]


def fit_with_frozen_heap(fit, *args, **kwargs):
    """Calls `fit(*args, **kwargs)` with a `FreezeHeapDuringFit` first among its callbacks.

    `fit` is `Model.fit` or a wrapper taking the same arguments. Arguments
    from `callbacks` on that `Model.fit` takes by position are passed on by
    keyword, so a wrapper of `fit` can add callbacks of its own. The heap is
    unfrozen however `fit` ends (an exception, or `SystemExit` after a
    preemption checkpoint).
    """
    position = _FIT_PARAMETERS.index("callbacks")
    if len(args) > position:
        kwargs.update(zip(_FIT_PARAMETERS[position:], args[position:]))
        args = args[:position]
    freezer = FreezeHeapDuringFit()
    kwargs["callbacks"] = with_callback_first(freezer, kwargs.get("callbacks"))
    try:
        return fit(*args, **kwargs)
    finally:
        freezer.heap.stop()


def call_with_frozen_heap(function, *args, **kwargs):
    """`function(*args, **kwargs)` (e.g. `Model.evaluate`) inside a `FrozenHeap`."""
    with FrozenHeap():
        return function(*args, **kwargs)
