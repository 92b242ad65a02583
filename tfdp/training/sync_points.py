"""Where replicas that step locally (local SGD, DiLoCo) synchronise outside the train step.

With `sync_every > 1` the replicas' weights differ between synchronisations
(`tfdp.distribute.local_sync`). Whatever reads the weights as *the* model's
must see them synchronised: evaluation, the end of an epoch (checkpoints,
`summary.json`), the end of training. Under `tfdp.compile`, `model.fit`
synchronises after the last batch of every epoch (before validation), again
at the epoch's end when the number of batches is unknown, and at the end of
training; `model.evaluate` synchronises first. `tfdp.Trainer` calls
`sync_pending` itself at the same points. Each call synchronises only if a
local step was taken since the last synchronisation (then one all-reduce of
the weights), and every worker makes it at the same point.

A window therefore ends at `sync_every` steps or at the end of the epoch,
whichever comes first.
"""

from __future__ import annotations

import functools

import keras

from tfdp.training import step_monitor
from tfdp.training.callback_order import with_callback_first
from tfdp.training.nonfinite import guard_of


class SyncAtEpochEnd(keras.callbacks.Callback):
    """Synchronises the replicas' weights after the last batch of each epoch and at the end of `fit`.

    After each synchronisation it raises `NonFiniteError` if the workers
    agreed there to stop (a replica reached `max_consecutive_nonfinite`;
    `tfdp.training.step_monitor`), on every worker alike.
    """

    def __init__(self, optimizer, monitor: step_monitor.StepMonitor | None):
        super().__init__()
        self._optimizer = optimizer
        self._monitor = monitor  # fit's own (`step_monitor.install_fit_check`), or None
        guard = guard_of(optimizer)
        self._overlap = bool(getattr(getattr(guard, "local_sync", None), "overlap", False))

    def _sync(self):
        self._optimizer.sync_pending()
        if self._monitor is not None:
            self._monitor.check()

    def on_train_batch_end(self, batch, logs=None):
        # Validation does not need it (fit validates through model.evaluate,
        # which syncs first, whatever validation_freq); it gives the last
        # batch's callbacks synchronised weights. Overriding it would turn off
        # Keras' asynchronous batch-end dispatch for the whole fit
        # (CallbackList._configure_async_dispatch), but Keras 3.15 never turns
        # that on with the TensorFlow backend (IS_THREAD_SAFE is False,
        # tensorflow/tensorflow#78338). If it ever does, remove this method
        # rather than mark it async_safe: a collective on the callback thread
        # would race the next train step.
        # Overlapped local steps (overlap_sync) end their windows here, between
        # calls of the train function, and start the all-reduce in a thread.
        self._optimizer.after_call()
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:
            self._sync()
        elif self._monitor is not None and self._overlap:
            self._monitor.check()  # a stop agreed at an overlapped window's end

    def on_epoch_end(self, epoch, logs=None):
        self._sync()

    def on_train_end(self, logs=None):
        self._sync()


def _fit(model, monitor, *args, callbacks=None, **kwargs):
    callbacks = with_callback_first(SyncAtEpochEnd(model.optimizer, monitor), callbacks)
    return type(model).fit(model, *args, callbacks=callbacks, **kwargs)


def _evaluate(model, *args, **kwargs):
    model.optimizer.sync_pending()
    return type(model).evaluate(model, *args, **kwargs)


#: The `keras.Model` methods `install_fit_sync` shadows on the instance.
METHODS = ("fit", "evaluate")


def install_fit_sync(model: keras.Model,
                     monitor: step_monitor.StepMonitor | None = None) -> None:
    """Makes `model.fit` and `model.evaluate` synchronise locally stepping replicas (see above).

    Instance attributes shadow `Model.fit` and `Model.evaluate`; `fit` finds
    `evaluate` on the instance when it validates. The SyncAtEpochEnd callback
    comes first, so checkpoint callbacks see synchronised weights; it checks
    `monitor` (fit's `StepMonitor`, None without a non-finite guard) after
    each synchronisation.
    """
    model.fit = functools.partial(_fit, model, monitor)
    model.evaluate = functools.partial(_evaluate, model)
