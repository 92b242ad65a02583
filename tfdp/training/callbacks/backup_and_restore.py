"""`BackupAndRestore`: a `model.fit` callback that resumes at the exact step.

This module owns the training state a Keras `fit` needs to continue after an
interruption (model, optimizer with its step counter and slots, and the
position: epoch, batch within it, steps per epoch), when it is saved (every
`save_freq`, and on SIGTERM) and restored (when `fit` starts), and removing it
when training completes. It does not own:

- chief-only writing: `tfdp.training.checkpointing.ChiefCheckpointManager` (the chief
  writes to `backup_dir`; other workers join each save, which is a collective
  under MultiWorkerMirroredStrategy, writing into a temporary directory they
  delete);
- the step every worker saves at after a SIGTERM, and the exit:
  `tfdp.distribute.preemption`;
- refusing to save non-finite weights: `tfdp.training.nonfinite`;
- the Keras internals that let `fit` start at epoch e, batch b:
  `tfdp._upstream.keras_fit_resume`.

Why not `keras.callbacks.BackupAndRestore`: in Keras 3.15 it records the batch
it saved at but restarts that epoch at batch 0, so the batches already applied
are applied twice (`tests/training/callbacks/test_keras_fit_resume.py` measures it);
every worker writes, and at the end deletes, the same files; and it ignores
SIGTERM.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Union

import keras
import tensorflow as tf
from absl import logging

from tfdp import _checks
from tfdp.training import batch as batch_lib
from tfdp.training import checkpointing
from tfdp.training import input_position
from tfdp.training import replica_state
from tfdp.training import step_monitor
from tfdp.distribute import preemption
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp._upstream import keras_fit_resume
from tfdp._upstream import keras_train_function

PREEMPTION_EXIT_CODE = preemption.PREEMPTION_EXIT_CODE

DatasetSource = Union[tf.data.Dataset, Callable[[int], tf.data.Dataset]]

_PROGRESS_NAMES = ("epoch", "batch", "step", "steps_per_epoch")


def _check_save_freq(save_freq) -> None:
    if save_freq == "epoch":
        return
    if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
        raise ValueError(
            "`save_freq` must be 'epoch' or a positive number of training steps "
            f"(global batches). Received: save_freq={save_freq!r}"
        )


def _check_exit_code(exit_code) -> None:
    if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
        raise ValueError(
            "`exit_code` must be an integer in [1, 255] (0 would tell a scheduler the "
            f"job finished). Received: exit_code={exit_code!r}"
        )


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up a `model.fit` run and resumes it exactly where it stopped.

    Saves the model, the optimizer (its `iterations` and slots) and the
    position (epoch, batch within the epoch, steps per epoch) with
    `tf.train.Checkpoint` into `backup_dir` every `save_freq` and when the
    process gets SIGTERM. When `fit` starts with a backup in `backup_dir`, it
    restores it and continues at that epoch and batch; when `fit` completes,
    it deletes the backup. Under every `tf.distribute` strategy, with
    `tfdp.compile(accum_steps=..., steps_per_execution=...)` too; under
    MultiWorkerMirroredStrategy only the chief writes to `backup_dir` (which
    every worker must be able to read, to restore).

    **The input contract.** A distributed iterator cannot be checkpointed
    (tensorflow/tensorflow#56372), so the input position is rebuilt instead:
    pass `fit` the input `backup.wrap(dataset_fn)` returns (no `y`, no
    `steps_per_epoch`). Epoch `e` is then one pass over `dataset_fn(e)`, a
    `tf.data.Dataset` of global batches whose order depends only on its seeds
    and `e` (seed the shuffle with the epoch; never rely on how many times it
    was iterated), with the same number of batches every epoch and in every
    run. A resumed epoch is entered at the first batch not yet applied
    (`tfdp.training.input_position`: `pipelines.make_dataset`'s datasets
    seek there without decoding or preprocessing the batches before; other
    inputs read them again, at most the epoch so far) and Keras numbers
    its steps from there, so each example is seen exactly once per epoch, the
    progress bar goes from `b+1/steps` to `steps/steps`, and the run ends
    with the same weights and `optimizer.iterations` as one that never
    stopped. Under MultiWorkerMirroredStrategy every worker builds the same
    global batches and `tf.distribute` splits them, as for any `fit` input.
    The restored epoch replaces `fit`'s `initial_epoch`; the metrics logged
    for the resumed epoch cover the batches run since the restart.

    Any other `fit` input (arrays, a dataset) resumes at epoch granularity
    only: `save_freq` must be `"epoch"`, and a SIGTERM mid-epoch exits without
    saving, so that epoch is trained again from its first batch (which is
    exact only if the input yields the same batches every epoch).

    **SIGTERM.** After the training step during which SIGTERM arrives (the
    `steps_per_execution` steps Keras runs between callbacks), every worker
    saves and the process exits with status `exit_code`: 42
    (`PREEMPTION_EXIT_CODE`) by default, the restart code of
    `tf.distribute.experimental.PreemptionCheckpointHandler`; rerun the same
    command to resume. Under MultiWorkerMirroredStrategy that handler makes
    the workers agree on the step (the next one: at most one step later than
    alone); on Google Cloud CPU/TPU VMs it does not watch SIGTERM (a warning
    says so). `fit` must run on the main thread for SIGTERM to be caught.

    Example:

    ```python
    backup = tfdp.callbacks.BackupAndRestore("runs/exp1/backup", save_freq=100)
    model.fit(backup.wrap(dataset_for_epoch), epochs=10, callbacks=[backup])
    ```

    Args:
        backup_dir: directory for the backup (local or any `tf.io.gfile`
            path). Use it for nothing else: at the end its checkpoint files
            are deleted, and the directory too if nothing else is in it.
        save_freq: `"epoch"` (save after every epoch; the default) or a
            number of training steps (global batches): save whenever the
            step count passes a multiple of it. With
            `steps_per_execution=k`, Keras runs callbacks every k steps, so it
            must be a multiple of k.
        delete_checkpoint: delete the backup when `fit` completes. Defaults
            to True.
        save_on_sigterm: save and exit on SIGTERM. Defaults to True.
        exit_code: exit status after a SIGTERM save, in [1, 255]. Defaults
            to 42.

    Raises:
        RuntimeError: `save_freq` is a number of steps and the installed
            Keras is outside the versions tfdp's resume patch was written for
            (`tfdp._upstream.keras_fit_resume`; the message names the Keras
            version, the upstream issue and the alternatives).
        ValueError: an argument is invalid (here), or, when `fit` starts:
            `backup_dir` holds a checkpoint of a different model or input
            (nothing in it is changed), `save_freq` is not a multiple of
            `steps_per_execution`, or a batch-level backup is asked for
            without `wrap`.
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        *,
        save_freq: int | str = "epoch",
        delete_checkpoint: bool = True,
        save_on_sigterm: bool = True,
        exit_code: int = PREEMPTION_EXIT_CODE,
    ):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(
                "`backup_dir` must be a non-empty path to a directory used only for "
                f"this backup. Received: backup_dir={backup_dir!r}"
            )
        _check_save_freq(save_freq)
        _check_exit_code(exit_code)
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.save_on_sigterm = bool(save_on_sigterm)
        self.exit_code = exit_code
        self._input: keras_fit_resume.EpochInput | None = None
        self._progress: dict[str, tf.Variable] = {}
        self._training = False
        self._watcher = None
        self._manager = None
        # Outside the Keras versions the patch was written for, nothing is
        # patched: refuse whatever would then resume at the wrong batch.
        self._can_resume_mid_epoch = keras_fit_resume.install()
        if save_freq != "epoch" and not self._can_resume_mid_epoch:
            raise RuntimeError(keras_fit_resume.unsupported_message(
                f"BackupAndRestore(save_freq={save_freq!r}) (a mid-epoch backup)"))

    # --- the input ------------------------------------------------------------

    def wrap(self, dataset: DatasetSource, *, steps_per_epoch: int | None = None):
        """The `fit` input that lets this callback resume mid-epoch exactly.

        Args:
            dataset: a callable `epoch -> tf.data.Dataset` of global batches
                whose order depends only on its seeds and `epoch` (reshuffle
                by seeding with the epoch), or a `tf.data.Dataset` that yields
                the same batches in the same order every time it is iterated.
                The callable may also return a distributed dataset (such as
                `pipelines.make_dataset` builds). A `pipelines.make_dataset`
                dataset with a `seed` (its `streams_epochs` holds) may be
                passed itself: epoch `e` then has an order of its own that
                depends only on the seed and `e`, and one iterator carries
                every epoch of the `fit` (`epoch_stream`): no pipeline
                build, iterator or iterator teardown per epoch. A resumed epoch is entered
                at its batch as `tfdp.training.input_position` says:
                `pipelines.make_dataset`'s datasets seek there without
                reading, preprocessing or copying the batches before it; any
                other `tf.data.Dataset` pulls them through its pipeline
                (`skip`), and any other distributed dataset also splits and
                copies them to the devices: the input work of the epoch so
                far.
            steps_per_epoch: batches per epoch; each epoch's dataset is cut to
                this many. Defaults to the cardinality of `dataset(0)`, which
                must then be known and finite (batch with
                `drop_remainder=True`, or
                `.apply(tf.data.experimental.assert_cardinality(n))`).

        Returns:
            An object to pass as `model.fit`'s `x` (no `y`, no
            `steps_per_epoch`), together with `callbacks=[this callback]`.

        Raises:
            TypeError: `dataset` is neither a dataset nor a callable returning
                one.
            ValueError: the steps per epoch are unknown or not positive.
            RuntimeError: the installed Keras is outside the versions
                `tfdp._upstream.keras_fit_resume` patches (the message names
                the alternatives).
        """
        if not self._can_resume_mid_epoch:
            raise RuntimeError(keras_fit_resume.unsupported_message("backup.wrap(...)"))
        datasets = (tf.data.Dataset, tf.distribute.DistributedDataset)
        epoch_stream = None
        if getattr(dataset, "streams_epochs", False):  # pipelines.make_dataset(..., seed=...)
            steps_per_epoch = steps_per_epoch or dataset.steps_per_epoch
            epoch_stream = functools.partial(dataset.epoch_stream,
                                             steps_per_epoch=steps_per_epoch)
            dataset_fn = lambda epoch: epoch_stream(epoch, 0, num_epochs=1)  # noqa: E731
        elif isinstance(dataset, datasets):
            fixed = dataset
            dataset_fn = lambda epoch: fixed  # noqa: E731
        elif callable(dataset):
            dataset_fn = dataset
        else:
            raise TypeError(
                "`dataset` must be a callable epoch -> tf.data.Dataset or a "
                f"tf.data.Dataset. Received: {type(dataset).__name__}"
            )
        # A stream is planned, not necessarily built (make_dataset(..., distribute=False)).
        first = dataset if epoch_stream is not None else dataset_fn(0)
        if epoch_stream is None and not isinstance(first, datasets):
            raise TypeError(
                "`dataset` must return a tf.data.Dataset of global batches (or a "
                "distributed dataset, e.g. from pipelines.make_dataset). "
                f"Received: dataset(0) -> {type(first).__name__}"
            )
        if steps_per_epoch is None:
            cardinality = batch_lib.num_batches(first)
            if cardinality < 1:
                kind = {-1: "infinite", -2: "unknown"}.get(cardinality, "zero")
                raise ValueError(
                    f"The number of batches of dataset(0) is {kind}, so the position "
                    "in an epoch cannot be restored. Pass steps_per_epoch=..., batch "
                    "with drop_remainder=True, or apply "
                    "tf.data.experimental.assert_cardinality(n)."
                )
            steps_per_epoch = cardinality
        else:
            _checks.check_int("steps_per_epoch", steps_per_epoch, allow_none=True)
        self._input = keras_fit_resume.EpochInput(
            dataset_fn, steps_per_epoch=steps_per_epoch, position=self._position,
            num_batches=batch_lib.num_batches, start_at=input_position.start_at_batch,
            epoch_stream=epoch_stream, can_bound_execution=self._can_bound_execution,
        )
        return self._input

    def _can_bound_execution(self) -> bool | None:
        """Whether the model's train function stops an execution at an epoch's end
        (None before `fit` has set the model)."""
        model = getattr(self, "model", None)
        return None if model is None else keras_train_function.takes_step_bound(model)

    def _position(self):
        """(epoch, first batch) for the epoch `fit` is starting.

        Before `on_train_begin` (Keras reads one batch of the input to build
        the model symbolically, under a strategy), the position the backup
        in `backup_dir` will resume at, so that the batch read is one the
        resumed epoch trains on, not one before its position (which
        `pipelines.make_dataset`'s seek would otherwise have to decode and
        preprocess); `None` (epoch 0) when there is none.
        """
        if self._training:
            return (self._epoch, self._batch)
        try:
            path = tf.train.latest_checkpoint(self.backup_dir)
            if path is None:
                return None
            values = {name: int(tf.train.load_variable(
                path, f"progress/{name}/.ATTRIBUTES/VARIABLE_VALUE"))
                for name in ("epoch", "batch", "steps_per_epoch")}
        except (tf.errors.OpError, ValueError, IndexError):
            return None  # on_train_begin refuses it, with the reason
        epoch, batch, steps = values["epoch"], values["batch"], values["steps_per_epoch"]
        if steps > 0 and batch >= steps:
            epoch, batch = epoch + 1, 0
        return epoch, batch

    # --- Keras hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if self._watcher is not None:  # a previous fit raised before on_train_end
            self._watcher.stop()
            self._watcher = None
        self._training = False
        model = self.model
        strategy = model.distribute_strategy
        self._info = strategy_info_lib.strategy_info(strategy)
        self._wrapped = self._input is not None and self._input.in_use
        if self._wrapped:
            self._input.in_use = False  # the next fit must adopt it again
            self._steps_per_epoch = self._input.num_batches
        else:
            self._steps_per_epoch = self.params.get("steps")
        self._check_fit_arguments()

        self._checkpoint = self._make_checkpoint()
        self._manager = checkpointing.ChiefCheckpointManager(
            self._checkpoint, self.backup_dir, is_chief=self._info.is_chief, max_to_keep=2,
            replica_state=replica_state.ReplicaStateFiles(
                self.backup_dir, strategy, lambda: self.model.optimizer, max_to_keep=2),
        )
        epoch, batch = self._restore()
        self._resume = (epoch, batch)
        self._epoch, self._batch = epoch, batch
        keras_fit_resume.set_initial_epoch(model, epoch)

        if self.save_on_sigterm:
            self._watcher = preemption.PreemptionWatcher(
                strategy=strategy,
                checkpoint=self._checkpoint,
                directory=self.backup_dir,
                save_fn=self._save_on_sigterm,
                exit_code=self.exit_code,
                owner="tfdp BackupAndRestore",
            )
            with self._manager.restoring_elsewhere():
                self._watcher.start()
            self._manager.restore_replica_state_again()  # the handler restored the chief's
        self._training = True

    def on_epoch_begin(self, epoch, logs=None):
        resume_epoch, resume_batch = self._resume or (None, 0)
        self._epoch = epoch
        self._batch = resume_batch if epoch == resume_epoch else 0
        self._resume = None

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        if self._steps_per_epoch:
            done = min(done, self._steps_per_epoch)
        if done > self._batch:
            before = self._step
            self._step += done - self._batch
            self._batch = done
            if self.save_freq != "epoch" and self._step // self.save_freq > before // self.save_freq:
                self._save()
        if self._watcher is not None:  # every worker, after every batch
            self._watcher.step_end()

    def on_epoch_end(self, epoch, logs=None):
        if self._steps_per_epoch and self._mid_epoch():  # stop_training part-way
            if self.save_freq == "epoch" and self._wrapped:
                self._save()
            return
        self._epoch, self._batch = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save()

    def on_train_end(self, logs=None):
        self._training = False
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        keras_fit_resume.clear_initial_epoch(self.model)
        if self.delete_checkpoint:
            # Every worker its own per-replica files; the chief the rest.
            if self._manager is not None and self._manager.replica_state is not None:
                self._manager.replica_state.delete()
            if self._info.is_chief:
                self._delete_backup()

    # --- helpers -----------------------------------------------------------------

    def _check_fit_arguments(self) -> None:
        steps_per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self.save_freq != "epoch" and self.save_freq % steps_per_execution:
            lower = self.save_freq // steps_per_execution * steps_per_execution
            options = " or ".join(
                str(n) for n in (lower, lower + steps_per_execution) if n > 0
            )
            raise ValueError(
                f"`save_freq` ({self.save_freq}) must be a multiple of the model's "
                f"steps_per_execution ({steps_per_execution}): Keras runs batch "
                f"callbacks only every {steps_per_execution} steps. Use save_freq="
                f"{options}."
            )
        if self.save_freq != "epoch" and not self._wrapped:
            raise ValueError(
                f"save_freq={self.save_freq} saves mid-epoch, which can only be "
                "resumed exactly when fit's input is backup.wrap(dataset_fn) (see the "
                "BackupAndRestore docstring). Pass x=backup.wrap(...), or use "
                "save_freq='epoch'."
            )
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model to restore into: give it a "
                "keras.Input, or call it on a batch, before fit()."
            )

    def _make_checkpoint(self) -> tf.train.Checkpoint:
        model = self.model
        optimizer = model.optimizer
        if not optimizer.built:  # its slots must exist to be restored
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        if not self._progress:
            # Plain variables: every worker holds the same values.
            with tf.init_scope():
                self._progress = {
                    name: tf.Variable(0, dtype=tf.int64, trainable=False, name=name)
                    for name in _PROGRESS_NAMES
                }
        return tf.train.Checkpoint(
            model=model, optimizer=optimizer, progress=tf.train.Checkpoint(**self._progress),
            **checkpointing.random_state(model),
        )

    def _refuse(self, problem: str, error: Exception | None = None):
        message = (
            f"backup_dir {self.backup_dir!r} {problem} Nothing in it was changed. "
            "Resume with the same model, optimizer and input, point backup_dir at an "
            "empty directory for this run, or delete the old backup if it is of no use."
        )
        raise ValueError(message) from error

    def _read_progress(self, path: str) -> dict[str, int]:
        """The saved position, read without restoring anything."""
        values = {}
        for name in _PROGRESS_NAMES:
            try:
                values[name] = int(tf.train.load_variable(
                    path, f"progress/{name}/.ATTRIBUTES/VARIABLE_VALUE"))
            except IndexError as error:  # a truncated data file
                self._refuse(
                    f"holds a checkpoint ({os.path.basename(path)}) that cannot be read: "
                    f"it is damaged or incomplete ({error}).", error)
            except (tf.errors.OpError, ValueError) as error:
                self._refuse(
                    f"holds a checkpoint ({os.path.basename(path)}) that BackupAndRestore "
                    f"did not write (no saved {name!r}).", error)
        return values

    def _restore(self) -> tuple[int, int]:
        """Restores the latest backup, if any; returns the (epoch, batch) to start at.

        Checks the saved position against this fit before restoring anything.
        """
        self._step = self._last_saved_step = 0
        path = self._manager.latest_checkpoint
        if path is None:
            return 0, 0
        values = self._read_progress(path)
        epoch, batch, saved_steps = values["epoch"], values["batch"], values["steps_per_epoch"]
        if saved_steps > 0 and self._steps_per_epoch and saved_steps != self._steps_per_epoch:
            self._refuse(
                f"holds a backup ({os.path.basename(path)}) written with {saved_steps} "
                f"steps per epoch; this fit has {self._steps_per_epoch}, so its position "
                "cannot be restored.")
        if saved_steps > 0 and batch >= saved_steps:
            epoch, batch = epoch + 1, 0
        if batch and not self._wrapped:
            raise ValueError(
                f"The backup {path} stopped mid-epoch (epoch {epoch}, batch {batch}); "
                "resuming there exactly needs fit's input to be backup.wrap(dataset_fn) "
                "(see the BackupAndRestore docstring). Pass x=backup.wrap(...)."
            )
        try:
            self._manager.restore_latest()
        except (ValueError, tf.errors.OpError) as error:
            # ChiefCheckpointManager says whether it does not match or is damaged.
            self._refuse(
                f"holds a checkpoint ({os.path.basename(path)}) that cannot be restored "
                f"into this model and optimizer: {error}", error)
        self._step = self._last_saved_step = values["step"]
        if self._info.is_chief:
            logging.info(
                "tfdp BackupAndRestore: resumed from %s at epoch %d, batch %d (step %d).",
                path, epoch, batch, self._step,
            )
        return epoch, batch

    def _save(self) -> None:
        """Saves the current state (a collective: every worker must call it)."""
        if self._step == self._last_saved_step:  # nothing new (or just restored)
            return
        quiesce = getattr(self.model.optimizer, "quiesce", None)
        if quiesce is not None:  # no overlapped all-reduce in flight during the save
            quiesce()
        # No synchronisation first under local steps (sync_every): each
        # worker's replicas save their own weights (tfdp.training.replica_state),
        # so a save does not end a window nor change the trajectory.
        values = {
            "epoch": self._epoch,
            "batch": self._batch,
            "step": self._step,
            "steps_per_epoch": self._steps_per_epoch or -1,
        }
        # Every worker holds the same weights, so all refuse alike.
        step_monitor.check_finite_before_save(
            [*self.model.weights, *self.model.optimizer.variables], step=self._step,
            owner="tfdp BackupAndRestore", last_saved=self._manager.latest_checkpoint,
        )
        for name, value in values.items():
            self._progress[name].assign(value)
        path = self._manager.save(self._step)
        self._last_saved_step = self._step
        if path:
            logging.info(
                "tfdp BackupAndRestore: saved %s (epoch %d, batch %d, step %d).",
                path, self._epoch, self._batch, self._step,
            )

    def _mid_epoch(self) -> bool:
        """Whether the current epoch has started but not finished."""
        if self._steps_per_epoch:
            return 0 < self._batch < self._steps_per_epoch
        return self._batch > 0

    def _save_on_sigterm(self) -> None:
        if self._mid_epoch() and not self._wrapped:
            logging.warning(
                "tfdp BackupAndRestore: fit's input is not backup.wrap(...), so a "
                "mid-epoch position cannot be resumed exactly; the backup stays at "
                "the end of the last epoch and epoch %d restarts from its first batch.",
                self._epoch,
            )
            return
        self._save()

    def _delete_backup(self) -> None:
        directory = self.backup_dir
        if not tf.io.gfile.isdir(directory):
            return
        ours = tf.io.gfile.glob(os.path.join(directory, "ckpt-*"))
        ours.append(os.path.join(directory, "checkpoint"))
        ours.append(os.path.join(directory, replica_state.SUBDIRECTORY))
        for path in ours:
            try:
                if tf.io.gfile.isdir(path):
                    tf.io.gfile.rmtree(path)
                elif tf.io.gfile.exists(path):
                    tf.io.gfile.remove(path)
            except tf.errors.NotFoundError:
                pass  # per-replica files another worker removed meanwhile
        if tf.io.gfile.listdir(directory):
            logging.warning(
                "tfdp BackupAndRestore: deleted the backup but kept %s, which holds "
                "other files.", directory,
            )
        else:
            tf.io.gfile.rmtree(directory)
