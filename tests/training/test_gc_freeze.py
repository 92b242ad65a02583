"""`tfdp.training.gc_freeze`: the heap frozen while a model trains, given back after.

Checked through the collector's own counters: `gc.get_freeze_count()` (the
objects in the permanent generation, which collections skip) and
`len(gc.get_objects())` (the objects a full collection walks). Under
`tfdp.compile` + `model.fit` and `tfdp.Trainer.train`, on 2 logical
replicas: frozen from the start, what the first trace built frozen too,
unfrozen at the end however training ends, and nothing touched when the
process manages its collector itself.
"""

from __future__ import annotations

import gc
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import gc_freeze

FEATURES = 4
GLOBAL_BATCH = 8
_rng = np.random.default_rng(3)
X = _rng.normal(size=(4 * GLOBAL_BATCH, FEATURES)).astype("float32")
Y = (X[:, 0] > 0).astype("float32")


@pytest.fixture(autouse=True)
def _collector_restored():
    """Every test starts and ends with automatic collection on and nothing frozen."""
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


def _compiled(sync_every: int = 1) -> keras.Model:
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, "relu"),
                                  keras.layers.Dense(1)])
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse",
                     metrics=["mae"], sync_every=sync_every)
    return model


class _Observe(keras.callbacks.Callback):
    """Records the collector's state at each epoch's end (after its evaluation)."""

    def __init__(self):
        super().__init__()
        self.frozen, self.walked = [], []
        self.frozen_at_begin = None

    def on_train_begin(self, logs=None):  # after tfdp's callback froze the heap
        self.frozen_at_begin = gc.get_freeze_count()

    def on_epoch_end(self, epoch, logs=None):
        self.frozen.append(gc.get_freeze_count())
        self.walked.append(len(gc.get_objects()))


def test_frozen_heap_freezes_at_start_and_at_each_first_mark_then_gives_all_back():
    heap = gc_freeze.FrozenHeap()
    with heap:
        assert heap.active
        at_start = gc.get_freeze_count()
        assert at_start > 1000  # the interpreter, TensorFlow and Keras at least
        built = [[i] for i in range(5000)]  # new containers: tracked, not frozen
        heap.mark("train")
        assert gc.get_freeze_count() >= at_start + 5000
        more = [[i] for i in range(5000)]
        heap.mark("train")  # already marked: nothing more is frozen
        assert gc.get_freeze_count() < at_start + 10000
        heap.mark("test")
        assert gc.get_freeze_count() >= at_start + 10000
        del built, more
    assert not heap.active
    assert gc.get_freeze_count() == 0
    heap.stop()  # a second stop does nothing
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
@pytest.mark.parametrize("managed", ["disabled", "frozen"])
def test_frozen_heap_leaves_a_process_that_manages_its_collector_alone(managed, monkeypatch):
    if managed == "disabled":
        gc.disable()
    else:
        gc.freeze()
    # The heap must neither freeze nor unfreeze. Watched at the calls: the
    # frozen count itself falls whenever another thread frees a frozen object
    # (a clean-clone CI run saw 1857527 -> 1857525 between two reads).
    calls = []
    for name in ("freeze", "unfreeze"):
        monkeypatch.setattr(gc, name, lambda name=name: calls.append(name))
    frozen_before = gc.get_freeze_count()
    with gc_freeze.FrozenHeap() as heap:
        assert not heap.active
        kept = [[i] for i in range(1000)]
        heap.mark("train")
    assert calls == []
    # Nothing new joined the permanent generation; the process's own freeze is kept.
    assert gc.get_freeze_count() <= frozen_before
    if managed == "frozen":
        assert gc.get_freeze_count() > 0
    assert gc.isenabled() == (managed == "frozen")
    del kept


@pytest.mark.slow
@pytest.mark.parametrize("sync_every", [1, 2])
def test_fit_collects_only_what_it_made_since_the_first_epoch_and_unfreezes_at_the_end(sync_every):
    model = _compiled(sync_every)
    observe = _Observe()
    walked_before = len(gc.get_objects())
    history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=3, verbose=0,
                        validation_data=(X, Y), callbacks=[observe])
    assert len(history.history["val_loss"]) == 3
    assert observe.frozen_at_begin > walked_before // 2
    # What the first train and test calls traced (tens of thousands of
    # objects even for this model) was frozen after them ...
    assert observe.frozen[0] > observe.frozen_at_begin + 5000, observe.frozen
    # ... so after the first epoch a full collection walks a small fraction
    # of what it walked before fit.
    assert max(observe.walked[1:]) < walked_before // 20, (walked_before, observe.walked)
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects()) > walked_before  # all of it handed back


@pytest.mark.slow
def test_fit_takes_callbacks_by_position_under_every_wrapper():
    for sync_every in (1, 2):
        model = _compiled(sync_every)
        observe = _Observe()
        # x, y, batch_size, epochs, verbose, callbacks, validation_split
        model.fit(X, Y, GLOBAL_BATCH, 2, 0, [observe], 0.25)
        assert len(observe.frozen) == 2 and min(observe.frozen) > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
@pytest.mark.parametrize("form", ["callback", "nested", "tuple", "CallbackList"])
def test_fit_takes_callbacks_in_every_form_keras_takes(form):
    # Keras flattens callbacks=... (a bare callback, nested lists) or uses a
    # CallbackList as it is; tfdp's wrappers put their own callback first in each.
    for sync_every in (1, 2):
        model = _compiled(sync_every)
        observe = _Observe()
        callbacks = {"callback": observe, "nested": [[observe]], "tuple": (observe,),
                     "CallbackList": keras.callbacks.CallbackList([observe], add_history=True,
                                                                  model=model)}[form]
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=callbacks)
        assert len(observe.frozen) == 2 and min(observe.frozen) > 0, (form, sync_every)
        if form == "CallbackList":
            assert len(callbacks.callbacks) == 2  # the user's list is left as it was
    assert gc.get_freeze_count() == 0


def test_the_wrapped_methods_show_keras_signatures_and_docs():
    for sync_every in (1, 2):
        model = _compiled(sync_every)
        for name in gc_freeze.METHODS:
            keras_method = getattr(keras.Model, name)
            assert (inspect.signature(getattr(model, name))
                    == inspect.signature(keras_method.__get__(model))), (name, sync_every)
            assert getattr(model, name).__doc__ == keras_method.__doc__


@pytest.mark.slow
def test_fit_unfreezes_when_it_raises():
    model = _compiled()

    class Fail(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            assert gc.get_freeze_count() > 0
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[Fail()])
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_fit_leaves_a_disabled_collector_alone():
    model = _compiled()
    observe = _Observe()
    gc.disable()
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[observe])
    assert observe.frozen == [0, 0]
    assert not gc.isenabled()


@pytest.mark.slow
@pytest.mark.parametrize("sync_every", [1, 2])
def test_evaluate_and_predict_run_frozen_and_give_everything_back(sync_every):
    model = _compiled(sync_every)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_test_batch_end=lambda batch, logs: seen.append(("test", gc.get_freeze_count())),
        on_predict_batch_end=lambda batch, logs: seen.append(("predict", gc.get_freeze_count())))
    walked_before = len(gc.get_objects())
    logs = model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, callbacks=[record],
                          return_dict=True)
    assert set(logs) == {"loss", "mae"}
    assert model.predict(X, batch_size=GLOBAL_BATCH, verbose=0, callbacks=[record]).shape == (
        len(X), 1)
    assert {what for what, _ in seen} == {"test", "predict"}
    assert min(frozen for _, frozen in seen) > walked_before // 2
    assert gc.get_freeze_count() == 0
    # Recompiling replaces tfdp's wrappers rather than stacking them.
    tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert model.evaluate.args[0].__self__ is model  # wraps Model.evaluate itself
    assert model.fit.args[0].__self__ is model


@pytest.mark.slow
def test_trainer_freezes_while_training_and_after_its_first_call():
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                           batch=tfdp.BatchConfig.from_global(GLOBAL_BATCH, 2))
    frozen, walked = [], []

    def loop_end():
        frozen.append(gc.get_freeze_count())
        walked.append(len(gc.get_objects()))

    trainer.train_loop_end = loop_end
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    walked_before = len(gc.get_objects())
    trainer.train(dataset, steps=6)
    assert len(frozen) == 6 and min(frozen) > walked_before // 2
    # The first call's trace is frozen after it (`train_loop_end` runs before).
    assert frozen[1] > frozen[0] + 5000, frozen
    assert max(walked[1:]) < walked_before // 20, (walked_before, walked)
    assert gc.get_freeze_count() == 0
    # Trainer.evaluate runs frozen as a whole, and gives everything back.
    in_eval = []
    eval_step = trainer._steps.eval_step  # pylint: disable=protected-access

    def observed_eval_step(data):
        in_eval.append(gc.get_freeze_count())
        return eval_step(data)

    trainer._steps.eval_step = observed_eval_step  # pylint: disable=protected-access
    trainer.evaluate(dataset)
    assert len(in_eval) == 4 and min(in_eval) > walked_before // 2, in_eval
    assert gc.get_freeze_count() == 0
