"""`tfdp.Trainer`'s asynchronous path: the outer loop under `ParameterServerStrategy`.

This module owns what the chief (the coordinator) does when the strategy is
TensorFlow's `ParameterServerStrategy`: which Trainer options apply
(`check_options`), the per-worker datasets
(`ClusterCoordinator.create_per_worker_dataset`), the rounds of steps it
schedules (`ClusterCoordinator.schedule`) and joins, and evaluation on the
chief. The step itself is the synchronous Trainer's
(`tfdp.training.replica_steps`: the loss as one device computes it on the
batch, the optimizer step skipped when not finite) run by one worker on one
batch; the variables it reads and updates live on the ps tasks. Checkpoints,
logging and summaries are `tfdp.Trainer`'s own (`_save`, `_log_progress`).
The cluster, servers and coordinator are `tfdp.distribute.parameter_server`'s.

**Steps and rounds.** A step is one batch of `batch.global_batch` examples on
one worker; `steps_per_loop` steps form one scheduled function. The chief
schedules a round (the rest of the epoch, cut at the next checkpoint), joins
it (every scheduled function has returned), then reads the metrics, logs,
and saves. Workers never wait for each other inside a round.

**A lost worker.** `schedule` runs each function at least once: when a
worker dies, TensorFlow puts its function back in the queue for the others,
and takes the worker back when it listens again on its address (its dataset
is rebuilt, from the beginning of its data). The steps a function reports
are summed over the round and checked against those scheduled. A function
cut short by the loss of its worker may have applied some of its steps
already, so `optimizer.iterations` may count a few more steps than were
scheduled: those updates were applied, and the loop counts them.

**Data.** Each worker reads the whole dataset, repeated, in its own order
if the dataset shuffles without a fixed seed (TensorFlow's advice for this
strategy); an epoch is `steps_per_epoch` steps over all workers, not one
pass of each example. A restored run resumes the weights, optimizer slots
and step count exactly; which examples it then reads is not replayed.
"""

from __future__ import annotations

import time

import keras
import tensorflow as tf
from absl import logging

from tfdp.distribute import parameter_server
from tfdp.training import batch as batch_lib

#: Trainer arguments that have no meaning without an all-reduce, with their
#: synchronous default.
_SYNCHRONOUS_OPTIONS = {
    "all_reduce_dtype": None,
    "gradient_compression": None,
    "sync_every": 1,
    "outer_optimizer": None,
    "shard_optimizer_state": False,
    "balance_batches": False,
    "bucket_cap_mb": None,
}


def check_options(*, batch, **options) -> None:
    """Refuses, by name, the Trainer options that need synchronous replicas.

    Args:
        batch: the Trainer's `BatchConfig`.
        **options: the Trainer arguments named in `_SYNCHRONOUS_OPTIONS`.

    Raises:
        ValueError: naming each option given that has no meaning here.
    """
    changed = {k: v for k, v in options.items() if v != _SYNCHRONOUS_OPTIONS[k]}
    if changed:
        raise ValueError(
            "tfdp.Trainer under ParameterServerStrategy trains asynchronously: each worker "
            "applies its own gradients on the ps tasks, with no all-reduce and no replicas "
            "to keep in step, so "
            f"{', '.join(f'{k}={v!r}' for k, v in changed.items())} cannot apply. Remove "
            f"{'it' if len(changed) == 1 else 'them'}, or train synchronously with "
            "tfdp.make_strategy() (MultiWorkerMirroredStrategy).")
    if batch.accum_steps != 1:
        raise ValueError(
            "tfdp.Trainer under ParameterServerStrategy applies each worker's batch as one "
            "step; gradient accumulation is not supported there. Use "
            f"tfdp.BatchConfig({batch.global_batch}, 1) (a larger batch per step) instead. "
            f"Received: batch.accum_steps={batch.accum_steps}")
    if keras.config.dtype_policy().name == "mixed_float16":
        raise ValueError(
            "tfdp.Trainer under ParameterServerStrategy does not support the mixed_float16 "
            "policy (its loss scale would be shared by workers stepping at different "
            "times). Use keras.config.set_dtype_policy('float32') or 'mixed_bfloat16'.")


class ParameterServerLoop:
    """The chief's loop of `tfdp.Trainer` under `ParameterServerStrategy`.

    Args:
        trainer: the `tfdp.Trainer` it runs for (its steps, optimizer,
            checkpoints and logging).
    """

    def __init__(self, trainer):
        from tfdp._upstream import keras_atomic_updates

        # Keras' assign_add is read-then-write: concurrent workers lose steps.
        keras_atomic_updates.apply()
        self._trainer = trainer
        self.coordinator = parameter_server.coordinator_of(trainer.strategy)
        self.num_workers = parameter_server.num_workers(trainer.strategy)
        steps = trainer._steps

        def train_function(iterator, num_steps):
            for _ in tf.range(num_steps):
                steps._step(next(iterator))
            return num_steps

        self._train_function = tf.function(train_function)
        self._eval_function = tf.function(self._eval_step)
        #: Over the last `train` call: steps scheduled; steps the scheduled
        #: functions reported back (equal when the call returns); and steps
        #: applied beyond those, by functions cut short with their worker
        #: and then run again (`scheduled_steps + extra_steps` is the steps
        #: the call applied).
        self.scheduled_steps = 0
        self.completed_steps = 0
        self.extra_steps = 0

    def _per_worker_iterator(self, dataset):
        if not isinstance(dataset, tf.data.Dataset):
            raise ValueError(
                "Under ParameterServerStrategy, tfdp.Trainer.train takes a tf.data.Dataset of "
                "global batches: each worker reads it, repeated, from its own copy "
                "(ClusterCoordinator.create_per_worker_dataset). Received: "
                f"{type(dataset).__name__}. Pass the dataset itself, not a function or a "
                "distributed dataset.")
        batch_lib.check_first_batch(dataset, self._trainer.batch, owner="tfdp Trainer")
        per_worker = self.coordinator.create_per_worker_dataset(dataset.repeat())
        return iter(per_worker)

    def train(self, dataset, global_step: int, total_steps: int, steps_per_epoch: int) -> dict:
        """Schedules steps until `total_steps` are applied; returns `Trainer.train`'s logs."""
        trainer = self._trainer
        iterator = self._per_worker_iterator(dataset)
        start_step, start_time = global_step, time.perf_counter()
        self.scheduled_steps = self.completed_steps = self.extra_steps = 0
        if trainer._monitor is not None:
            trainer._monitor.prime()
        logs: dict = {}
        while global_step < total_steps:
            epoch_end = (global_step // steps_per_epoch + 1) * steps_per_epoch
            end = min(total_steps, epoch_end)
            if trainer.checkpoint_every:
                end = min(end, (global_step // trainer.checkpoint_every + 1)
                          * trainer.checkpoint_every)
            if global_step % steps_per_epoch == 0 or global_step == start_step:
                trainer._reset(trainer._steps.train_loss, *trainer._steps.train_metrics)
            round_start = time.perf_counter()
            trainer.train_loop_begin()
            scheduled, remote = self._schedule_round(iterator, end - global_step)
            self.coordinator.join()
            completed = sum(int(value.fetch()) for value in remote)
            self.scheduled_steps += scheduled
            self.completed_steps += completed
            if completed != scheduled:
                raise RuntimeError(
                    f"tfdp trainer: the chief scheduled {scheduled} steps in this round but "
                    f"its functions reported {completed} back after join().")
            trainer.train_loop_end()
            logs = trainer._results(trainer._steps.train_loss, trainer._steps.train_metrics)
            elapsed = time.perf_counter() - round_start
            applied = self._applied_steps()
            if applied < end:
                raise RuntimeError(
                    f"tfdp trainer: after a round scheduled up to step {end}, the ps tasks count "
                    f"{applied} steps (optimizer.iterations + skipped_steps). Was the "
                    "optimizer stepped outside this Trainer?")
            if applied > end:
                self.extra_steps += applied - end
                logging.warning(
                    "tfdp trainer: %d step(s) beyond the %d scheduled were applied: a worker "
                    "was lost during its function and TensorFlow ran the function again "
                    "elsewhere.", applied - end, end)
            trainer._log_progress(applied, total_steps, logs,
                                  scheduled * trainer.batch.global_batch / elapsed)
            global_step = applied
            if trainer.checkpoint_every and end % trainer.checkpoint_every == 0:
                trainer._save(global_step)
            trainer._position = global_step
            if trainer._watcher is not None:  # SIGTERM: save this round's state and exit 42
                trainer._watcher.step_end()
        if trainer._checkpoints is not None and global_step > start_step:
            trainer._save(global_step)
        elapsed = time.perf_counter() - start_time
        return {
            **logs,
            "steps": global_step,
            "epochs": global_step / steps_per_epoch,
            "skipped_steps": trainer.skipped_steps,
            "examples_per_second": (self.completed_steps * trainer.batch.global_batch / elapsed
                                    if self.completed_steps else 0.0),
        }

    def _schedule_round(self, iterator, num_steps: int):
        """Schedules `num_steps` steps in functions of `steps_per_loop`; returns (steps, remote values)."""
        remote, scheduled = [], 0
        while scheduled < num_steps:
            num = min(self._trainer.steps_per_loop, num_steps - scheduled)
            remote.append(self.coordinator.schedule(
                self._train_function, args=(iterator, tf.constant(num))))
            scheduled += num
        return scheduled, remote

    def _applied_steps(self) -> int:
        """Steps applied on the ps tasks (raises at the non-finite limit)."""
        trainer = self._trainer
        if trainer._monitor is not None:
            return trainer._monitor.check()
        return trainer.global_step

    def _eval_step(self, data):
        steps = self._trainer._steps
        steps._replica_eval_step(data)

    def evaluate(self, dataset) -> dict:
        """Evaluates on the chief, reading the weights from the ps tasks."""
        trainer = self._trainer
        if not isinstance(dataset, tf.data.Dataset):
            raise ValueError(
                "Under ParameterServerStrategy, tfdp.Trainer.evaluate takes a finite "
                "tf.data.Dataset of global batches, which the chief reads. Received: "
                f"{type(dataset).__name__}")
        self.coordinator.join()  # every scheduled update applied
        trainer._reset(trainer._steps.eval_loss, *trainer._steps.eval_metrics)
        for data in dataset:
            self._eval_function(data)
        return trainer._results(trainer._steps.eval_loss, trainer._steps.eval_metrics)
