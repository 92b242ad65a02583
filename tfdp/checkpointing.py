"""Chief-aware checkpoint saving and restoring for multi-worker training.

Every worker must take part in a save (reading a variable synchronised on
read, such as a batch-norm statistic, joins a collective), but only the chief
may write to `model_dir`: other workers write into a temporary directory and
delete it straight after, as tf-keras' `distribute/distributed_file_utils.py`
does. This module owns that rule; what goes into a checkpoint is the caller's.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf


class ChiefCheckpointManager:
    """Saves `checkpoint` to `directory` on the chief, and to nowhere lasting elsewhere.

    Args:
        checkpoint: the `tf.train.Checkpoint` to save and restore.
        directory: where the chief keeps checkpoints.
        is_chief: whether this worker owns `directory`.
        max_to_keep: checkpoints the chief keeps. Defaults to 3.
    """

    def __init__(
        self, checkpoint: tf.train.Checkpoint, directory: str, *, is_chief: bool, max_to_keep: int = 3
    ):
        self._checkpoint = checkpoint
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
            AssertionError from TensorFlow's status check is re-raised as
            ValueError when the checkpoint does not match the objects (for
            example a checkpoint of a different model in `directory`).
        """
        latest = self.latest_checkpoint
        if latest is None:
            return None
        status = self._checkpoint.restore(latest)
        try:
            status.assert_existing_objects_matched()
        except AssertionError as error:
            raise ValueError(
                f"The checkpoint {latest} does not match this model and optimizer "
                f"({error}). Point model_dir at a new directory, or at the "
                f"checkpoints of this same model."
            ) from error
        return latest
