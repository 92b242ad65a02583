"""State each replica keeps for itself, saved by every worker beside the chief's checkpoint.

The chief's checkpoint holds one copy of every variable: right for the
weights and for what every replica computes alike, wrong for what each
replica keeps of its own:

- a gradient compressor's error-feedback memories (and PowerSGD's warm-start
  Q; `tfdp.distribute.compression`), which differ per replica;
- with local steps (`sync_every`, `tfdp.distribute.local_sync`), the inner
  optimizer's slots (momentum, Adam's moments), which every replica updates
  with its own gradients, and the weights, which differ inside a window: a
  checkpoint does not synchronise them (that would end the window and change
  the trajectory), it saves every replica's copy;
- with sharded optimizer state (`shard_optimizer_state=True`,
  `tfdp.distribute.optimizer_sharding`), the inner optimizer's slots: each
  replica's hold its own chunk of every variable.

At every save each worker writes its replicas' copies of these variables to
`<directory>/replica_state/ckpt-<step>/worker-<i>-of-<n>.npz` (NumPy's
format, no pickles; written to a temporary name and renamed), before the
chief writes the checkpoint itself; at a restore each worker reads its own
file back into its replicas. The chief's checkpoint plus these files is the
whole state, so a resumed run ends exactly as an uninterrupted one.

On another number of workers or replicas, sharded optimizer state is
re-partitioned (`Repartition`): each worker reads every old worker's file of
the step (so they must all be where it can read them: a shared `model_dir`),
puts the old replicas' chunks end to end and cuts them for the new count;
what the chief's checkpoint holds of the inner optimizer (replica 0's
chunks) is read into a stand-in and dropped. From a run on one replica
(nothing sharded, no files) the whole slots come from the chief's checkpoint.
Error-feedback memories and local optimizer slots cannot be split or merged
exactly: there the restore refuses, naming both layouts and the way out.

This is the one place where a worker other than the chief writes into the
checkpoint directory: each writes only its own files, which on hosts without
a shared filesystem stay on the host that needs them again.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp.distribute import shard_layout
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.training import wrapping

SUBDIRECTORY = "replica_state"


def _exchange_of(optimizer):
    """The exchange of a tfdp optimizer wrapper; None for any other optimizer."""
    guard = wrapping.guard_of(optimizer)
    return None if guard is None else guard.exchange


def variables_of(optimizer) -> list:
    """The variables of a tfdp optimizer wrapper that differ between replicas (may be empty).

    What its exchange declares (`tfdp.training.exchanges.Exchange.state_variables`).
    """
    exchange = _exchange_of(optimizer)
    return [] if exchange is None else list(exchange.state_variables)


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
        optimizer: returns the optimizer (a tfdp wrapper, or any Keras
            optimizer, which keeps nothing per replica); called at each save
            and restore, so it may be built later.
        max_to_keep: steps whose files this worker keeps (as the checkpoints).
    """

    def __init__(self, directory: str, strategy: tf.distribute.Strategy,
                 optimizer: Callable[[], object], *, max_to_keep: int):
        self._root = os.path.join(directory, SUBDIRECTORY)
        self._strategy = strategy
        self._optimizer = optimizer
        self._max_to_keep = max_to_keep
        info = strategy_info_lib.strategy_info(strategy)
        self._worker, self._workers = info.worker_index, info.num_workers
        self._local_replicas = strategy.num_replicas_in_sync // max(info.num_workers, 1)

    def _variables(self) -> list:
        return variables_of(self._optimizer())

    @property
    def _file_name(self) -> str:
        return f"worker-{self._worker}-of-{self._workers}.npz"

    def _files_by_layout(self, step: int) -> dict[int, dict[int, str]]:
        """`{workers: {worker: path}}` of the files on disk for `step`."""
        directory = self._step_directory(step)
        if not tf.io.gfile.isdir(directory):
            return {}
        layouts: dict[int, dict[int, str]] = {}
        for entry in tf.io.gfile.listdir(directory):
            match = re.fullmatch(r"worker-(\d+)-of-(\d+)\.npz", entry)
            if match:
                layouts.setdefault(int(match.group(2)), {})[int(match.group(1))] = (
                    os.path.join(directory, entry))
        return layouts

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

    def plan_restore(self, step: int):
        """How the files of `step` are loaded: `None` by `restore`, else a `Repartition`.

        Call before restoring anything else of that checkpoint: with sharded
        optimizer state written by another number of replicas, the chief's
        checkpoint itself holds chunks of other shapes, which only the
        `Repartition`'s stand-in can take.

        Raises:
            ValueError: the files of `step` were written by another number of
                replicas and hold state that cannot be re-partitioned
                (error-feedback memories, local optimizer slots), or are
                incomplete; nothing is changed.
        """
        optimizer = self._optimizer()
        exchange = _exchange_of(optimizer)
        sharding = None if exchange is None else exchange.sharding
        layouts = self._files_by_layout(step)
        own = layouts.get(self._workers, {}).get(self._worker)
        if own is not None and _local_replicas_of(own) == self._local_replicas:
            return None
        if sharding is None:
            if own is not None:
                raise self._other_layout(step, own, _local_replicas_of(own))
            return None  # restore() says what is missing
        if not exchange.state_repartitions:  # e.g. error memories beside the chunks
            if layouts:
                raise self._other_layout(step, own or sorted(
                    p for files in layouts.values() for p in files.values())[0],
                    _local_replicas_of(own) if own else None)
            return None
        if not layouts:
            # Written on one replica (nothing sharded, no files): the chief's
            # checkpoint holds the whole slots; cut them if this run shards.
            return Repartition(self._strategy, optimizer, None) if sharding.active else None
        if own is None and self._workers in layouts:
            return None  # this worker's file is missing: restore() says so
        complete = sorted(workers for workers, files in layouts.items()
                          if sorted(files) == list(range(workers)))
        if own is not None and self._workers in complete:
            complete = [self._workers]  # beside it, a later run's files of this step
        if len(complete) != 1:
            raise ValueError(
                f"The checkpoint of step {step} keeps sharded optimizer state in "
                f"{self._step_directory(step)}, but "
                + ("not the files of every worker that wrote it"
                   if not complete else f"in {len(complete)} complete layouts ({complete} workers)")
                + f" ({', '.join(sorted(os.path.basename(p) for f in layouts.values() for p in f.values()))}). "
                "To resume on another number of workers, every worker must read every file "
                "of that step: keep model_dir on a filesystem all workers share, or resume "
                "with the number of workers that wrote it. Nothing was changed.")
        files = layouts[complete[0]]
        old = [_read(files[worker]) for worker in range(complete[0])]
        repartition = Repartition(self._strategy, optimizer, old)
        repartition.prepare()  # refuses other optimizers' state before anything is restored
        return repartition

    def _other_layout(self, step: int, path: str, saved_replicas) -> ValueError:
        written = (f"{saved_replicas} replica(s) per worker"
                   if saved_replicas is not None else "another number of replicas")
        return ValueError(
            f"The checkpoint of step {step} was written by {written} ({path}); this run has "
            f"{self._local_replicas} per worker on {self._workers} worker(s). Its per-replica "
            f"state (error-feedback memories or local optimizer slots) is laid out per replica "
            f"and cannot be re-partitioned exactly. Nothing was changed. Resume "
            f"with the devices and workers that wrote it (the same devices or cpu_replicas), "
            f"or start a new model_dir from the weights alone."
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
        data = _read(path)
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


def _read(path: str) -> dict:
    with tf.io.gfile.GFile(path, "rb") as f:
        return dict(np.load(io.BytesIO(f.read()), allow_pickle=False))


def _local_replicas_of(path: str) -> int:
    return int(_read(path)["local_replicas"])


class Repartition:
    """Sharded optimizer state of a checkpoint written by another number of replicas, loaded into this one.

    Use `standing_in()` around every restore of the chief's checkpoint (the
    one here, and TensorFlow's `PreemptionCheckpointHandler`'s), then
    `apply()`.

    Args:
        strategy: this run's strategy.
        optimizer: this run's tfdp optimizer wrapper, with `sharding` set and
            built.
        old_files: every old worker's file, in worker order (replica
            `worker * replicas_per_worker + r` is the r-th copy of worker
            `worker`, as `replica_id_in_sync_group` numbers them); `None`
            when the old run had one replica, whose whole slots the chief's
            checkpoint holds.
    """

    def __init__(self, strategy, optimizer, old_files):
        self._strategy = strategy
        self._optimizer = optimizer
        self._old_files = old_files
        self._whole = None  # the stand-in's values, when it holds the whole slots
        self._values = None  # per inner variable, this worker's replicas' new values
        info = strategy_info_lib.strategy_info(strategy)
        self._worker = info.worker_index
        self._local_replicas = strategy.num_replicas_in_sync // max(info.num_workers, 1)

    @contextlib.contextmanager
    def standing_in(self):
        """Within: the checkpoint's part of the inner optimizer restores into a stand-in.

        The stand-in is an optimizer of the same class and configuration:
        unbuilt when the old run sharded (its chunks, of other shapes, stay
        pending in it and are dropped), built on the weights when it did not
        (its whole slots are kept for `apply`).
        """
        wrapper = self._optimizer
        real = wrapper.inner_optimizer
        with self._strategy.scope():
            stand_in = type(real).from_config(real.get_config())
            if self._old_files is None:
                stand_in.build(_exchange_of(self._optimizer).sharding.variables)
        wrapper.inner_optimizer = stand_in
        try:
            yield
        finally:
            wrapper.inner_optimizer = real
        if self._old_files is None and self._whole is None:
            # The first restore's values; a later one (TensorFlow's handler, if
            # on a cluster) reads the same checkpoint, or nothing at all.
            self._whole = [np.asarray(keras.ops.convert_to_numpy(v)) for v in stand_in.variables]

    def _old_values(self, index: int) -> list[np.ndarray]:
        """Every old replica's copy of the inner optimizer's variable `index`, in replica order."""
        if self._old_files is None:
            return [self._whole[index]]
        values = []
        for data in self._old_files:
            values += [data[f"v{index}_r{r}"] for r in range(int(data["local_replicas"]))]
        return values

    def prepare(self) -> None:
        """Cuts the old state for this worker's replicas, without assigning anything.

        Raises:
            ValueError: the old state is of another optimizer or model (other
                variables or sizes).
        """
        inner = self._optimizer.inner_optimizer
        sharding = _exchange_of(self._optimizer).sharding
        weights = sharding.variables
        variables = list(inner.variables)
        if self._old_files is None and self._whole is None:
            raise RuntimeError("Repartition: the whole slots come from the checkpoint; "
                               "restore it within standing_in() first.")
        old_count = (len(self._whole) if self._old_files is None
                     else len(self._old_files[0]["names"]))
        if old_count != len(variables):
            raise ValueError(
                f"The checkpoint's optimizer state has {old_count} variables; this run's "
                f"{type(inner).__name__} has {len(variables)}. Resume with the optimizer "
                "that wrote it. Nothing was changed.")
        owners = shard_layout.slot_variables(inner, len(weights))
        first = self._worker * self._local_replicas
        values = []
        for index, (variable, owner) in enumerate(zip(variables, owners)):
            old = self._old_values(index)
            if owner is None:
                per_replica = [old[0]] * self._local_replicas
            else:
                weight = weights[owner]
                cut = shard_layout.repartition(
                    old, int(np.prod(weight.shape)), sharding.num_shards if sharding.active else 1)
                if sharding.active:
                    per_replica = [cut[first + r] for r in range(self._local_replicas)]
                else:
                    per_replica = [cut[0].reshape(weight.shape)] * self._local_replicas
            for value in per_replica:
                if tuple(value.shape) != tuple(variable.shape):
                    raise ValueError(
                        f"The checkpoint's optimizer variable {index} re-partitioned has shape "
                        f"{tuple(value.shape)}; this run's {variable.path} has "
                        f"{tuple(variable.shape)}. Resume with the optimizer and model that "
                        "wrote it. Nothing was changed.")
            values.append(per_replica)
        self._values = values

    def apply(self) -> None:
        """Loads the re-partitioned state into this worker's replicas (after `standing_in`)."""
        if self._values is None:
            self.prepare()
        for variable, per_replica in zip(self._optimizer.inner_optimizer.variables, self._values):
            copies = self._strategy.experimental_local_results(_distributed(variable))
            for copy, value in zip(copies, per_replica):
                copy.assign(value)
