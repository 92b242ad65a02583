"""Lets Keras 3 `model.fit` start an epoch part-way through, at an exact batch.

This module owns every touch of Keras private state that
`tfdp.callbacks.BackupAndRestore` needs to resume `fit` exactly (Keras 3.15,
TensorFlow backend). It does not decide what to save or when; the callback
does.

Upstream: Keras 3's `keras.callbacks.BackupAndRestore` records the batch it
saved at but restarts that epoch at batch 0 (its input position is not
restored: keras-team/keras-hub#204; keras-team/keras#22490, closed unmerged,
says the same: "the data pipeline restarts from the beginning ... the model
sees early data twice"), and a distributed iterator cannot be checkpointed
(tensorflow/tensorflow#56372). Resuming at (epoch e, batch b) needs three
things Keras has no public hook for:

1. `model._initial_epoch`. `fit` starts at `self._initial_epoch or
   initial_epoch`, read right after `callbacks.on_train_begin()`; Keras' own
   callback sets it there too, and nothing resets it, so a later `fit` of the
   same model would silently skip epochs: `clear_initial_epoch` undoes it.
2. A custom `DataAdapter` as `x`. `data_adapters.get_data_adapter` returns an
   instance of `DataAdapter` unchanged ("Allow passing a custom data
   adapter"), so `EpochInput` (a `DataAdapter`) can be `fit`'s input and learn
   each epoch's dataset from a callable.
3. `EpochIterator._enumerate_iterator`, the generator `fit` loops over each
   epoch, always numbers steps from 0 and iterates one dataset object.
   `install()` wraps it once, for the whole process: when the epoch
   iterator's data adapter is an `EpochInput`, the `EpochInput` runs the
   epoch instead (a fresh distributed iterator over `dataset_fn(epoch)`
   entered at batch `b`, steps numbered `b, b + k, ...` up to the epoch's
   end, `k` = `steps_per_execution`); every other input runs Keras' own
   generator unchanged. How the first `b` batches are passed over is the
   caller's `start_at` (`tfdp.training.input_position.start_at_batch`: a
   seek for `pipelines.make_dataset`'s datasets, `skip` or iterator
   advances for others). With an `epoch_stream` (one dataset carrying
   every epoch, `make_dataset(...).epoch_stream`), one distributed iterator
   serves consecutive epochs instead: no pipeline build, iterator, or
   iterator teardown per epoch (the teardown of a MultiDeviceIterator alone
   took 0.5-2.4 s per epoch on 2 workers, measured 2026-11-27). An epoch
   whose steps do not divide into executions then hands its last execution
   a `keras_train_function.StepBound`, so that it stops at the epoch's end.
4. `fit(class_weight=...)`. Keras hands `class_weight` to
   `data_adapters.get_data_adapter`, which returns a `DataAdapter` input
   unchanged and drops it. `install()` also wraps that function: for an
   `EpochInput` it records the class weights, and each epoch's
   `tf.data.Dataset` gets them as sample weights with Keras' own map
   (`tf_dataset_adapter.make_class_weight_map_fn`, what Keras does to a
   dataset `x`); a distributed dataset cannot be mapped, so that is refused.

`tests/training/callbacks/test_keras_fit_resume.py` checks each of these against the
installed Keras (and that Keras' own callback still re-applies batches, the
reason this module exists); `is_supported()` gates `install()` on the Keras
versions it was written against.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import keras
import tensorflow as tf

from tfdp._upstream import _versions
from tfdp._upstream import keras_train_function as _keras_train_function

from keras.src.trainers import data_adapters as _data_adapters
from keras.src.trainers import epoch_iterator as _epoch_iterator
from keras.src.trainers.data_adapters import data_adapter as _data_adapter
from keras.src.trainers.data_adapters import tf_dataset_adapter as _tf_dataset_adapter

# pylint: disable=protected-access

#: Keras (major, minor) versions this module was written against, inclusive.
KNOWN_KERAS_RANGE = ((3, 0), (3, 15))

_PATCH_MARKER = "__tfdp_keras_fit_resume_patch__"
_lock = threading.Lock()


def is_supported(keras_version: str | None = None) -> bool:
    """Whether `keras_version` (default: the installed one) is in `KNOWN_KERAS_RANGE`."""
    return _versions.keras_in_range(KNOWN_KERAS_RANGE, keras_version)


def unsupported_message(feature: str) -> str:
    """Why `feature` cannot resume mid-epoch on the installed Keras, and what to do instead.

    For the refusal of a caller that needs `install()` and got False.
    """
    low, high = KNOWN_KERAS_RANGE
    return (
        f"{feature} needs tfdp's patch of Keras' epoch loop "
        f"(tfdp/_upstream/keras_fit_resume.py), written for Keras {low[0]}.{low[1]} to "
        f"{high[0]}.{high[1]}; the installed Keras {keras.__version__} is outside that "
        f"range, so it is not applied, and a resumed epoch would restart at its first "
        f"batch and apply the batches already trained twice (the upstream bug: "
        f"keras-team/keras-hub#204, keras-team/keras#22490). Either back up once per "
        f"epoch (BackupAndRestore(save_freq='epoch') with fit's own input, not "
        f"backup.wrap(...)), train with tfdp.Trainer (which resumes mid-epoch without "
        f"Keras' epoch loop), or install keras<={high[0]}.{high[1]}."
    )


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the `fit` now calling `on_train_begin` start at `epoch`."""
    model._initial_epoch = epoch or None


def clear_initial_epoch(model: keras.Model) -> None:
    """Undoes `set_initial_epoch`, so a later `fit` honours its `initial_epoch`."""
    model._initial_epoch = None


class EpochInput(_data_adapter.DataAdapter):
    """`fit` input whose every epoch is `dataset_fn(epoch)`, optionally entered mid-way.

    Built by `tfdp.callbacks.BackupAndRestore.wrap`, which documents the
    contract; this class only binds it to Keras.

    Args:
        dataset_fn: `epoch -> tf.data.Dataset` of global batches.
        steps_per_epoch: batches per epoch (every epoch's dataset is cut to
            this many).
        position: called when an epoch starts; returns `(epoch, first_batch)`
            to run, or `None` outside a `fit` that uses the owning callback
            (Keras' symbolic build peeks at one batch then: epoch 0 is used).
        num_batches: `dataset -> int`, the batches in one epoch's dataset (-1
            infinite, -2 unknown); the caller's (`tfdp.training.batch.num_batches`),
            so that this module depends on nothing of tfdp's.
        start_at: `(dataset, batch) -> (dataset, still_to_skip)`: the epoch's
            dataset entered at `batch`, and how many batches its distributed
            iterator must still consume (the caller's,
            `tfdp.training.input_position.start_at_batch`).
        epoch_stream: `(epoch, batch, num_epochs=None) -> dataset` of the
            epochs from `(epoch, batch)` on in one dataset, each
            `steps_per_epoch` batches, or None. With it, `dataset_fn` is not
            called: the epochs run on the stream's iterator.
        can_bound_execution: whether the model's train function honours a
            `keras_train_function.StepBound` (needed for executions of more
            than one step on the stream); None before the model is known
            (Keras' symbolic build, which reads one batch).
    """

    def __init__(
        self,
        dataset_fn: Callable[[int], tf.data.Dataset],
        *,
        steps_per_epoch: int,
        position: Callable[[], tuple[int, int] | None],
        num_batches: Callable[[Any], int],
        start_at: Callable[[Any, int], tuple[Any, int]],
        epoch_stream: Callable[[int, int], Any] | None = None,
        can_bound_execution: Callable[[], bool | None] = lambda: False,
    ):
        self._dataset_fn = dataset_fn
        self._steps_per_epoch = steps_per_epoch
        self._position = position
        self._num_batches = num_batches
        self._start_at = start_at
        self._epoch_stream = epoch_stream
        self._can_bound_execution = can_bound_execution
        # The open stream's iterator and the (epoch, batch) it will yield next.
        self._stream_iterator = None
        self._stream_next: tuple[int, int] | None = None
        self._stream_built: tuple[tuple[int, int], Any] | None = None  # (position, dataset)
        self.in_use = False  # set when a `fit` adopts this input
        self.class_weight = None  # fit's `class_weight`, recorded by the patched get_data_adapter
        # How an epoch's dataset reaches the replicas: None, the strategy's
        # `experimental_distribute_dataset` for a tf.data.Dataset (split per
        # replica; a distributed dataset as it is); or `dataset -> distributed
        # dataset` for every epoch, set by whoever feeds the replicas
        # otherwise (balanced batches: every replica each batch whole).
        self.distribute: Callable[[tf.data.Dataset], Any] | None = None

    def adopt_class_weight(self, class_weight) -> None:
        """Records `fit(class_weight=...)` for the epochs of this `fit` (None: none)."""
        if class_weight is not None and isinstance(
                self._dataset_fn(0), tf.distribute.DistributedDataset):
            raise ValueError(
                "fit(class_weight=...) cannot be applied to a backup.wrap(...) input whose "
                "epochs are distributed datasets (they cannot be mapped after "
                "distribution). Turn the class weights into sample weights in the input "
                "pipeline (yield (x, y, weight) with weight = class_weight[y]), or return "
                "tf.data.Datasets of global batches from dataset_fn."
            )
        self.class_weight = class_weight

    def dataset(self, epoch: int, skip: int = 0):
        """The global batches of `epoch` from batch `skip` on.

        Returns `(dataset, still_to_skip)`. The dataset is entered at `skip`
        by the caller's `start_at`; a `tf.data.Dataset` is then cut to the
        epoch's remaining batches. A distributed dataset that cannot be
        entered there is returned whole, and `enumerate_epoch` consumes its
        first `still_to_skip` batches (reading them, training nothing).
        """
        if self._epoch_stream is not None:  # this epoch alone, entered where asked
            dataset, left = self._epoch_stream(epoch, skip, num_epochs=1), 0
        else:
            dataset = self._dataset_fn(epoch)
            if not isinstance(dataset, (tf.data.Dataset, tf.distribute.DistributedDataset)):
                raise TypeError(
                    f"`dataset_fn` must return a tf.data.Dataset of global batches or a "
                    f"distributed dataset. Received: dataset_fn({epoch}) -> "
                    f"{type(dataset).__name__}"
                )
            batches = self._num_batches(dataset)
            if 0 <= batches < self._steps_per_epoch:
                raise ValueError(
                    f"Every epoch must have the same number of batches ({self._steps_per_epoch}) "
                    f"for its position to be restorable. Received: dataset_fn({epoch}) has "
                    f"{batches}. Keep the data and global batch the same in every epoch "
                    f"(batch with drop_remainder=True)."
                )
            dataset, left = self._start_at(dataset, skip)
        if isinstance(dataset, tf.distribute.DistributedDataset):
            return dataset, left
        if self.class_weight is not None:  # as Keras' TFDatasetAdapter does
            dataset = dataset.map(
                _tf_dataset_adapter.make_class_weight_map_fn(self.class_weight))
        return dataset.take(self._steps_per_epoch - skip), 0

    # --- the DataAdapter interface fit uses (TensorFlow backend) -------------

    def get_tf_dataset(self):
        self.in_use = True
        if self._epoch_stream is not None:
            # Keras keeps it only for the epochs of its own loop, which
            # `enumerate_epoch` replaces; its symbolic build peeks at one
            # batch through `enumerate_epoch` too. The stream built here for
            # the position `fit` will start at is the one its epochs then use.
            dataset = self._stream_dataset(*(self._position() or (0, 0)))
        else:
            dataset = self.dataset(0)[0]
        return dataset if self.distribute is None else self.distribute(dataset)

    def _distributed(self, iterator, dataset):
        """`dataset` (a `tf.data.Dataset` of global batches) as the replicas read it."""
        if self.distribute is not None:
            return self.distribute(dataset)
        strategy = iterator._distribute_strategy or tf.distribute.get_strategy()
        return strategy.experimental_distribute_dataset(dataset)

    @property
    def num_batches(self):
        return self._steps_per_epoch

    @property
    def batch_size(self):
        return None

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None

    def get_numpy_iterator(self):
        raise NotImplementedError("EpochInput serves the TensorFlow backend only.")

    get_jax_iterator = get_numpy_iterator
    get_torch_dataloader = get_numpy_iterator

    # --- the epoch loop ------------------------------------------------------

    def enumerate_epoch(self, iterator):
        """Replaces `EpochIterator._enumerate_iterator` for this input.

        Yields `(first_step, last_step, distributed_iterator)` like Keras, with
        steps numbered from the batch the epoch is entered at.
        """
        if iterator.steps_per_epoch and iterator.steps_per_epoch != self._steps_per_epoch:
            raise ValueError(
                f"With a tfdp BackupAndRestore input, an epoch is one pass over "
                f"dataset_fn(epoch) ({self._steps_per_epoch} batches); do not pass "
                f"`steps_per_epoch` to fit. Received: steps_per_epoch="
                f"{iterator.steps_per_epoch}. Set it in backup.wrap(..., "
                f"steps_per_epoch=...) instead."
            )
        epoch, start = self._position() or (0, 0)
        step_size = iterator.steps_per_execution
        if self._streams(step_size):
            yield from self._enumerate_stream(iterator, epoch, start, step_size)
            return
        dataset, left = self.dataset(epoch, start)
        if self.distribute is not None:  # refuses what it cannot distribute
            distributed = iter(self.distribute(dataset))
        elif isinstance(dataset, tf.distribute.DistributedDataset):
            distributed = iter(dataset)
            if left:
                _skip_batches(distributed, tf.constant(left))
        else:
            distributed = iter(self._distributed(iterator, dataset))
        for step in range(start, self._steps_per_epoch, step_size):
            yield step, step + step_size - 1, distributed

    def _streams(self, step_size: int) -> bool:
        """Whether this epoch runs on the one iterator of `epoch_stream`.

        An epoch whose steps do not divide into executions of `step_size`
        ends part-way through one: the train function must then take a step
        bound (`keras_train_function.StepBound`), or the execution would run
        on into the next epoch's batches.
        """
        if self._epoch_stream is None or self.class_weight is not None:
            return False
        # None: no model yet, so this is Keras' symbolic build reading one
        # batch before `fit` starts; one batch never needs a bound.
        return step_size == 1 or self._can_bound_execution() in (True, None)

    def _enumerate_stream(self, iterator, epoch: int, start: int, step_size: int):
        """`enumerate_epoch` on one iterator over every epoch (`epoch_stream`).

        The iterator is kept while each epoch runs to its end, and reused by
        the next epoch if that starts where this one ended; any other
        position (a resume, a `fit` stopped part-way) opens a new one.
        """
        if self._stream_next != (epoch, start):
            self._close_stream()
            stream = self._stream_dataset(epoch, start)
            if self.distribute is not None or isinstance(stream, tf.data.Dataset):
                stream = self._distributed(iterator, stream)
            self._stream_iterator = iter(stream)
        distributed = self._stream_iterator
        self._stream_next = None  # until this epoch has run to its end
        steps = self._steps_per_epoch
        for step in range(start, steps, step_size):
            if step + step_size > steps:  # the epoch ends part-way through this execution
                yield step, step + step_size - 1, _keras_train_function.StepBound(
                    distributed, steps - step)
            else:
                yield step, step + step_size - 1, distributed
        self._stream_next = (epoch + 1, 0)

    def _stream_dataset(self, epoch: int, start: int):
        """`epoch_stream(epoch, start)`, built once per position."""
        if self._stream_built is None or self._stream_built[0] != (epoch, start):
            self._stream_built = ((epoch, start), self._epoch_stream(epoch, start))
        return self._stream_built[1]

    def _close_stream(self) -> None:
        """Drops the stream's iterator (a new position, or the end of its use)."""
        self._stream_iterator = None
        self._stream_next = None


@tf.function
def _skip_batches(iterator, count):
    """Consumes `count` batches of a distributed iterator on every worker alike."""
    for _ in tf.range(count):
        next(iterator)


def _make_enumerate_iterator(original: Callable) -> Callable:
    def _enumerate_iterator(self):
        if isinstance(self.data_adapter, EpochInput):
            return self.data_adapter.enumerate_epoch(self)
        return original(self)

    return _enumerate_iterator


def _make_get_data_adapter(original: Callable) -> Callable:
    def get_data_adapter(x, *args, **kwargs):
        if isinstance(x, EpochInput):
            x.adopt_class_weight(kwargs.get("class_weight"))
            return x
        return original(x, *args, **kwargs)

    return get_data_adapter


def install() -> bool:
    """Routes `fit`'s epoch loop through `EpochInput` when it is the input.

    Also makes `fit(class_weight=...)` reach an `EpochInput` (item 4 above).

    Idempotent; a no-op (returning False) on Keras versions outside
    `KNOWN_KERAS_RANGE`.

    Returns:
        True if the patch is in place after the call.
    """
    if not is_supported():
        return False
    with _lock:
        current = _epoch_iterator.EpochIterator._enumerate_iterator
        if not getattr(current, _PATCH_MARKER, False):
            replacement = _make_enumerate_iterator(current)
            setattr(replacement, _PATCH_MARKER, True)
            replacement.__wrapped__ = current
            _epoch_iterator.EpochIterator._enumerate_iterator = replacement
        current = _data_adapters.get_data_adapter
        if not getattr(current, _PATCH_MARKER, False):
            replacement = _make_get_data_adapter(current)
            setattr(replacement, _PATCH_MARKER, True)
            replacement.__wrapped__ = current
            _data_adapters.get_data_adapter = replacement
    return True


def uninstall() -> bool:
    """Restores Keras' own `_enumerate_iterator` and `get_data_adapter`; True if patched."""
    with _lock:
        restored = False
        current = _epoch_iterator.EpochIterator._enumerate_iterator
        if getattr(current, _PATCH_MARKER, False):
            _epoch_iterator.EpochIterator._enumerate_iterator = current.__wrapped__
            restored = True
        current = _data_adapters.get_data_adapter
        if getattr(current, _PATCH_MARKER, False):
            _data_adapters.get_data_adapter = current.__wrapped__
            restored = True
        return restored
