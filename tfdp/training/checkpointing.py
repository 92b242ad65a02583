"""Chief-aware checkpoint saving and restoring for multi-worker training.

Every worker must take part in a save (reading a variable synchronised on
read, such as a batch-norm statistic, joins a collective), but only the chief
may write to `model_dir`: other workers write into a temporary directory and
delete it straight after, as tf-keras' `distribute/distributed_file_utils.py`
does. This module owns that rule; what goes into a checkpoint is the caller's.
State that differs per replica (`tfdp.training.replica_state`) is the
exception: every worker writes its own file of it at each save.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import tensorflow as tf


def random_state(model) -> dict:
    """`{"random_state": [...]}` for a `tf.train.Checkpoint`: `model`'s random-number state, or `{}`.

    Keras 3 layers that draw random numbers (`Dropout`, `GaussianNoise`,
    random augmentation layers) keep their generator's state in a
    `SeedGenerator`, which TensorFlow's checkpoints do not track (it is not a
    trackable object): a run restored from a checkpoint would draw its masks
    from the generator's initial state again, and end with other weights
    than an uninterrupted run. `model.variables` lists those states beside the
    weights (Keras' `Layer.variables`), so the states are what it holds that
    `model.weights` does not. Empty for a model without them, so its
    checkpoints keep their layout.
    """
    weights = {id(w) for w in model.weights}
    states = [getattr(v, "value", v) for v in model.variables if id(v) not in weights]
    return {"random_state": states} if states else {}


class ChiefCheckpointManager:
    """Saves `checkpoint` to `directory` on the chief, and to nowhere lasting elsewhere.

    Args:
        checkpoint: the `tf.train.Checkpoint` to save and restore.
        directory: where the chief keeps checkpoints.
        is_chief: whether this worker owns `directory`.
        max_to_keep: checkpoints the chief keeps. Defaults to 3.
        replica_state: every worker's per-replica state
            (`tfdp.training.replica_state.ReplicaStateFiles`), saved and
            restored with each checkpoint; `None` for none.
    """

    def __init__(
        self, checkpoint: tf.train.Checkpoint, directory: str, *, is_chief: bool, max_to_keep: int = 3,
        replica_state=None,
    ):
        self._checkpoint = checkpoint
        self.replica_state = replica_state
        self._restored_step = None
        self._repartition = None
        self._directory = directory
        self._is_chief = is_chief
        self._manager = (
            tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)
            if is_chief
            else None
        )

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def latest_checkpoint(self) -> str | None:
        """Path prefix of the newest complete checkpoint in `directory`, or `None`."""
        return tf.train.latest_checkpoint(self._directory)

    def save(self, step: int) -> str | None:
        """Saves on every worker; returns the chief's checkpoint path (`None` elsewhere)."""
        if self.replica_state is not None:
            # First, so that a checkpoint the chief completed has every worker's file.
            self.replica_state.save(step)
        if self._is_chief:
            return self._manager.save(checkpoint_number=step)
        scratch = tempfile.mkdtemp(prefix="tfdp-worker-checkpoint-")
        try:
            self._checkpoint.write(os.path.join(scratch, f"ckpt-{step}"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return None

    def restore_latest(self) -> str | None:
        """Restores the newest checkpoint, if any; returns its path.

        Raises:
            ValueError: the checkpoint does not match the objects (for
                example a checkpoint of a different model in `directory`), or
                it cannot be read (truncated or damaged files). Nothing in
                `directory` is changed.
        """
        latest = self.latest_checkpoint
        if latest is None:
            return None
        repartition = None
        if self.replica_state is not None:
            from tfdp.training import replica_state  # pylint: disable=import-outside-toplevel

            # Before anything is restored: a clear refusal instead of a shape
            # error, or the stand-in that takes chunks of another layout.
            repartition = self.replica_state.plan_restore(replica_state.step_of(latest))
        try:
            with self._standing_in(repartition):
                status = self._checkpoint.restore(latest)
                status.assert_existing_objects_matched()
                if repartition is not None:
                    status.expect_partial()  # the stand-in drops the old chunks, knowingly
        except AssertionError as error:
            raise self._mismatch(latest, error) from error
        except ValueError as error:  # e.g. a variable of another shape
            raise self._mismatch(latest, error) from error
        except (tf.errors.OpError, IndexError) as error:
            # A truncated data file raises IndexError ("Read less bytes than
            # requested") from the reader; a damaged index, an OpError.
            raise ValueError(
                f"The checkpoint {latest} cannot be read: it is damaged or "
                f"incomplete ({type(error).__name__}: {error}). Nothing was changed. "
                f"Move its files ({os.path.basename(latest)}.*) out of "
                f"{self._directory} and edit the `checkpoint` file there to name an "
                f"older checkpoint (or delete it to start over), or point model_dir "
                f"at a new directory."
            ) from error
        if self.replica_state is not None:
            from tfdp.training import replica_state  # pylint: disable=import-outside-toplevel

            self._restored_step = replica_state.step_of(latest)
            self._repartition = repartition
            self._load_replica_state()
        return latest

    @staticmethod
    def _standing_in(repartition):
        return repartition.standing_in() if repartition is not None else contextlib.nullcontext()

    def _load_replica_state(self) -> None:
        if self._repartition is not None:
            self._repartition.apply()
        else:
            self.replica_state.restore(self._restored_step)

    def restoring_elsewhere(self):
        """A context for a restore of the last checkpoint by other code (TensorFlow's).

        Wrap the start of a `tfdp.distribute.preemption.PreemptionWatcher` in
        it and call `restore_replica_state_again` after: on a cluster,
        TensorFlow's `PreemptionCheckpointHandler` restores the chief's
        checkpoint when it is built, which with optimizer state written by
        another number of replicas only the stand-in can take.
        """
        return self._standing_in(self._repartition)

    def restore_replica_state_again(self) -> None:
        """Loads the per-replica state of the last restore again.

        Call after starting a `tfdp.distribute.preemption.PreemptionWatcher`
        on a cluster (inside `restoring_elsewhere`): TensorFlow's
        `PreemptionCheckpointHandler` restores the chief's checkpoint when it
        is built, over every replica's own state.
        """
        if self.replica_state is not None and self._restored_step is not None:
            self._load_replica_state()

    @staticmethod
    def _mismatch(path: str, error: Exception) -> ValueError:
        return ValueError(
            f"The checkpoint {path} does not match this model and optimizer "
            f"({error}). Nothing was changed. Point model_dir at a new directory, "
            f"or at the checkpoints of this same model."
        )
