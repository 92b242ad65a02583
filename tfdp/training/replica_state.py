"""State each replica keeps for itself, saved by every worker beside the chief's checkpoint.

The chief's checkpoint holds one copy of every variable: right for the
weights and for what every replica computes alike, wrong for what each
replica keeps of its own:

- a gradient compressor's error-feedback memories (and PowerSGD's warm-start
  Q; `tfdp.distribute.compression`), which differ per replica;
- with local steps (`sync_every`, `tfdp.distribute.local_sync`), the inner
  optimizer's slots (momentum, Adam's moments), which every replica updates
  with its own gradients. The weights need nothing: a checkpoint ends a
  window, so they are synchronised when saved;
- with sharded optimizer state (`shard_optimizer_state=True`,
  `tfdp.distribute.optimizer_sharding`), the inner optimizer's slots: each
  replica's hold its own chunk of every variable.

At every save each worker writes its replicas' copies of these variables to
`<directory>/replica_state/ckpt-<step>/worker-<i>-of-<n>.npz` (NumPy's
format, no pickles; written to a temporary name and renamed), before the
chief writes the checkpoint itself; at a restore each worker reads its own
file back into its replicas. The chief's checkpoint plus these files is the
whole state, so a resumed run ends exactly as an uninterrupted one. On
another number of workers or replicas the files cannot be split or merged
exactly: the restore refuses, naming both layouts and the way out.

This is the one place where a worker other than the chief writes into the
checkpoint directory: each writes only its own files, which on hosts without
a shared filesystem stay on the host that needs them again.
"""

from __future__ import annotations

import io
import os
import re
from typing import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp.distribute import strategy_info as strategy_info_lib

SUBDIRECTORY = "replica_state"


def variables_of(optimizer) -> list:
    """The variables of a tfdp optimizer wrapper that differ between replicas (may be empty)."""
    compressor = getattr(optimizer, "compressor", None)
    found = list(compressor.state) if compressor is not None else []
    sharding = getattr(optimizer, "sharding", None)
    if getattr(optimizer, "local_sync", None) is not None or (
            sharding is not None and sharding.active):
        found += list(optimizer.inner_optimizer.variables)
    return found


def _distributed(variable):
    # A Keras variable's tf.Variable (its `value` property); a tf.Variable's
    # `value` is a method, and the variable itself is what is wanted.
    return variable.value if isinstance(variable, keras.Variable) else variable


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def step_of(checkpoint_path: str) -> int:
    """The step of a checkpoint path `.../ckpt-<step>`."""
    match = re.search(r"-(\d+)$", checkpoint_path)
    if match is None:
        raise ValueError(f"Cannot read a step from the checkpoint path {checkpoint_path!r}.")
    return int(match.group(1))


class ReplicaStateFiles:
    """Every worker's per-replica state for each checkpoint step (see the module docstring).

    Args:
        directory: the checkpoint directory (`model_dir`, `backup_dir`).
        strategy: the strategy the variables were created under.
        variables: returns the per-replica variables (read at each save and
            restore, so the optimizer may be built later).
        max_to_keep: steps whose files this worker keeps (as the checkpoints).
    """

    def __init__(self, directory: str, strategy: tf.distribute.Strategy,
                 variables: Callable[[], Sequence], *, max_to_keep: int):
        self._root = os.path.join(directory, SUBDIRECTORY)
        self._strategy = strategy
        self._variables = variables
        self._max_to_keep = max_to_keep
        info = strategy_info_lib.strategy_info(strategy)
        self._worker, self._workers = info.worker_index, info.num_workers
        self._local_replicas = strategy.num_replicas_in_sync // max(info.num_workers, 1)

    @property
    def _file_name(self) -> str:
        return f"worker-{self._worker}-of-{self._workers}.npz"

    def _step_directory(self, step: int) -> str:
        return os.path.join(self._root, f"ckpt-{step}")

    def save(self, step: int) -> None:
        """Writes this worker's file for `step` (no collective), and drops its files of old steps."""
        variables = list(self._variables())
        if not variables:
            return
        # Names for people; the check on restore is by order and shape (Keras
        # numbers optimizer variables' paths per process: `sgd`, `sgd_1`, ...).
        arrays = {"local_replicas": np.array(self._local_replicas),
                  "names": np.array([_name(v) for v in variables], dtype=str)}
        for index, variable in enumerate(variables):
            copies = self._strategy.experimental_local_results(_distributed(variable))
            for replica, copy in enumerate(copies):
                arrays[f"v{index}_r{replica}"] = np.asarray(copy.numpy())
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        directory = self._step_directory(step)
        tf.io.gfile.makedirs(directory)
        path = os.path.join(directory, self._file_name)
        temporary = path + ".tmp"
        with tf.io.gfile.GFile(temporary, "wb") as f:
            f.write(buffer.getvalue())
        tf.io.gfile.rename(temporary, path, overwrite=True)
        self._drop_old(step)

    def _steps_on_disk(self) -> list[int]:
        if not tf.io.gfile.isdir(self._root):
            return []
        steps = []
        for entry in tf.io.gfile.listdir(self._root):
            match = re.fullmatch(r"ckpt-(\d+)/?", entry)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def _drop_old(self, newest: int) -> None:
        kept = [s for s in self._steps_on_disk() if s <= newest][-self._max_to_keep:]
        for step in self._steps_on_disk():
            if step in kept:
                continue
            directory = self._step_directory(step)
            path = os.path.join(directory, self._file_name)
            try:
                if tf.io.gfile.exists(path):
                    tf.io.gfile.remove(path)
                if not tf.io.gfile.listdir(directory):
                    tf.io.gfile.rmtree(directory)
            except tf.errors.OpError:
                pass  # another worker removed it first

    def check_layout(self, step: int) -> None:
        """Raises ValueError when the files of `step` were written by another number of replicas per worker.

        Call before restoring anything else of that checkpoint: with sharded
        optimizer state the chief's checkpoint itself holds chunk-shaped
        variables, which would fail to load with a message about shapes.
        """
        if not list(self._variables()):
            return
        path = os.path.join(self._step_directory(step), self._file_name)
        if not tf.io.gfile.exists(path):
            return  # restore() says what is missing
        with tf.io.gfile.GFile(path, "rb") as f:
            saved_replicas = int(np.load(io.BytesIO(f.read()), allow_pickle=False)["local_replicas"])
        if saved_replicas != self._local_replicas:
            raise ValueError(
                f"The checkpoint of step {step} was written by {saved_replicas} replica(s) per "
                f"worker ({path}); this run has {self._local_replicas}. Its per-replica state "
                f"(sharded optimizer state, error-feedback memories or local optimizer slots) "
                f"is laid out per replica and is not re-partitioned. Nothing was changed. Resume "
                f"with {saved_replicas} replica(s) per worker (the same devices or "
                f"cpu_replicas), or start a new model_dir from the weights alone."
            )

    def restore(self, step: int) -> None:
        """Loads this worker's file for `step` into its replicas' copies.

        Raises:
            ValueError: the files of `step` were written by another number of
                workers or replicas, or for other variables; nothing is changed.
        """
        variables = list(self._variables())
        if not variables:
            return
        directory = self._step_directory(step)
        path = os.path.join(directory, self._file_name)
        if not tf.io.gfile.exists(path):
            others = (sorted(tf.io.gfile.listdir(directory))
                      if tf.io.gfile.isdir(directory) else [])
            if others:
                raise ValueError(
                    f"The checkpoint of step {step} keeps per-replica state (error-feedback "
                    f"memories, local optimizer slots) written by other workers ({', '.join(others)} "
                    f"in {directory}), not by worker {self._worker} of {self._workers}. It cannot "
                    f"be split or merged exactly over another number of workers. Resume with "
                    f"the number of workers that wrote it, or delete {self._root} to resume "
                    f"from the chief's weights with that state started afresh (not exact)."
                )
            logging.warning(
                "tfdp: the checkpoint of step %d has no per-replica state for worker %d "
                "(%s missing): error-feedback memories and local optimizer slots start "
                "from the chief's checkpoint, so this run will not end exactly like an "
                "uninterrupted one.", step, self._worker, path)
            return
        with tf.io.gfile.GFile(path, "rb") as f:
            data = dict(np.load(io.BytesIO(f.read()), allow_pickle=False))
        shapes = [tuple(v.shape) for v in variables]
        saved_shapes = [data[f"v{i}_r0"].shape for i in range(len(data["names"]))]
        saved_replicas = int(data["local_replicas"])
        if saved_replicas != self._local_replicas or saved_shapes != shapes:
            raise ValueError(
                f"{path} holds per-replica state for {saved_replicas} replica(s) per worker "
                f"and {len(saved_shapes)} variable(s) of shapes {saved_shapes}; this run has "
                f"{self._local_replicas} and {len(shapes)} of shapes {shapes}. Resume with the same devices per worker and the same "
                f"gradient_compression / sync_every / shard_optimizer_state, or delete {self._root} to start that "
                f"state afresh (not exact)."
            )
        for index, variable in enumerate(variables):
            copies = self._strategy.experimental_local_results(_distributed(variable))
            for replica, copy in enumerate(copies):
                copy.assign(data[f"v{index}_r{replica}"])

    def delete(self) -> None:
        """Removes this worker's files (and the directory once empty)."""
        for step in self._steps_on_disk():
            path = os.path.join(self._step_directory(step), self._file_name)
            if tf.io.gfile.exists(path):
                tf.io.gfile.remove(path)
        try:
            if tf.io.gfile.isdir(self._root):
                for step in self._steps_on_disk():
                    if not tf.io.gfile.listdir(self._step_directory(step)):
                        tf.io.gfile.rmtree(self._step_directory(step))
                if not tf.io.gfile.listdir(self._root):
                    tf.io.gfile.rmtree(self._root)
        except tf.errors.OpError:
            pass  # another worker removed it first
