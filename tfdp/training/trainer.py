"""A custom data-parallel training loop that resumes exactly.

`Trainer` owns the outer loop (epochs, logging, TensorBoard summaries,
checkpoints, resuming), Orbit's controller side; the inner loop (a replica
step inside a `tf.function` that runs `steps_per_loop` optimizer steps per
call) is `tfdp.training.replica_steps`'s. Batch arithmetic comes from
`tfdp.training.batch`, chief-only checkpoint writing from `tfdp.training.checkpointing`, the
save-and-exit on SIGTERM from `tfdp.distribute.preemption` (shared with the `fit`
callback), skipping non-finite steps from `tfdp.training.nonfinite`; input pipelines are
the caller's (`pipelines.make_dataset`, or any dataset).

Resuming exactly. TensorFlow 2.21 cannot put a distributed iterator into a
`tf.train.Checkpoint` (tensorflow/tensorflow#56372), so the input position is
restored another way: the checkpoint holds the optimizer step and the number
of skipped non-finite steps, whose sum is the number of global batches
consumed; the epoch and the position inside it follow from `steps_per_epoch`;
the dataset for an
epoch is rebuilt (`dataset(epoch)` when `dataset` is a callable, whose order
must depend only on its seed and the epoch) and entered at the batch the
epoch had reached. A resumed run then sees each example exactly once per
epoch and ends with the same weights as a run that never stopped.

What entering costs is `tfdp.training.input_position`'s: nothing for the
skipped examples with `pipelines.make_dataset` (it seeks), and for other
inputs the input work of the epoch so far (never more than one epoch). A
dataset of unknown size (`cardinality() == -2`, e.g. after `filter`) is
trained epoch by epoch until it ends; the checkpoint then also holds the
epoch and the step it began at (`input_position/epoch`,
`input_position/epoch_start`), so a resume re-enters that epoch only.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence, Union

import keras
import tensorflow as tf
from absl import logging

from tfdp import _checks
from tfdp.training import checkpointing
from tfdp.training import gc_freeze
from tfdp.training import loss_normalization as norm_lib
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training import balanced_batches
from tfdp.training import option_rules
from tfdp.training import parameter_server_loop
from tfdp.training import replica_state
from tfdp.training import replica_steps
from tfdp.training import step_monitor
from tfdp.training import summaries
from tfdp.distribute import preemption
from tfdp.distribute import compression
from tfdp.distribute import devices
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.distribute import parameter_server
from tfdp.distribute import shard_layout
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.training import batch as batch_lib
from tfdp.training.batch import BatchConfig
from tfdp.training.exchanges import bucketed

DatasetLike = Union[tf.data.Dataset, tf.distribute.DistributedDataset, Any]
DatasetSource = Union[DatasetLike, Callable[[int], DatasetLike]]


class Trainer:
    """Trains a Keras model data-parallel in a custom loop, resumable exactly.

    Build the model (and any metric objects you pass) inside
    `strategy.scope()`; the trainer creates the optimizer's slots there too.

    **Steps.** A training step is one global batch. `train(steps=...)`,
    epochs, `global_step`, `checkpoint_every` and checkpoint numbers count
    training steps, skipped ones included; `optimizer.iterations` (and so
    learning-rate schedules) counts the updates applied:
    `global_step == optimizer.iterations + skipped_steps`.

    **SIGTERM.** With a `model_dir`, a SIGTERM makes every worker save a
    checkpoint after the same training step (the end of the `steps_per_loop`
    call during which it arrived; under MultiWorkerMirroredStrategy the
    workers agree on it through
    `tf.distribute.experimental.PreemptionCheckpointHandler`, at most one call
    later), only the chief writing to `model_dir`, and then the process exits
    with status 42 (`tfdp.callbacks.PREEMPTION_EXIT_CODE`; `SystemExit` is
    raised from `train`). Rerunning the same `train` call resumes from that
    checkpoint exactly. `train` must run on the main thread for this.

    **Non-finite steps.** With `nonfinite="skip"` (the default), a step whose
    loss or gradients hold a NaN or Inf on any replica is skipped by every
    replica and worker alike: weights, optimizer slots and
    `optimizer.iterations` stay as they were, and `skipped_steps` counts it
    (it is checkpointed). What the forward pass updates (metrics,
    BatchNormalization moving statistics) is not undone. After
    `max_consecutive_nonfinite` skipped steps in a row, `train` raises
    `tfdp.training.nonfinite.NonFiniteError` naming the steps and the usual fixes.
    `"raise"` stops at the first one (never applying it); `None` applies
    whatever the gradients are (Keras' behaviour), except under
    `mixed_float16`, where an overflowing step is skipped (halving the loss
    scale) as Keras' loss scaling does, with no limit, and counted. In every
    mode a checkpoint whose weights are not finite is never written (`train`
    raises `NonFiniteError` instead). The decision costs no collective (see
    `tfdp.training.nonfinite`). With local steps (`sync_every`) there is no
    per-step collective: each replica skips its own non-finite steps, and a
    replica at the limit stops everyone at the next synchronisation, where
    every worker raises the same `NonFiniteError`
    (`tfdp.distribute.local_sync`).

    **ParameterServerStrategy.** Under `tfdp.make_strategy(kind="parameter_server")`
    the trainer runs on the chief and trains asynchronously: each step is one
    batch on whichever worker is free, applied on the ps tasks without waiting
    for the others (`tfdp.training.parameter_server_loop`, which says how steps
    are scheduled and counted, what a lost worker costs, and how data is read).
    The options of the all-reduce (`all_reduce_dtype`, `gradient_compression`,
    `sync_every`, `outer_optimizer`, `shard_optimizer_state`,
    `balance_batches`) and accumulation are refused there; `fit` and
    `tfdp.compile` refuse the strategy.

    Args:
        model: a built Keras model whose variables were created in
            `strategy.scope()`.
        optimizer: a Keras optimizer instance created in `strategy.scope()`.
            `Trainer.optimizer` wraps it: in `tfdp.training.nonfinite.NonFiniteGuard`
            (`nonfinite` not `None`), or under the `mixed_float16` policy in a
            `LossScaleOptimizer` whose replicas all skip a step when any
            replica's gradients overflow (`NonFiniteLossScaleOptimizer`, in
            every `nonfinite` mode: it decides from the all-reduced scaled
            gradients, then unscales them).
        loss: a Keras loss (name, function or `keras.losses.Loss`, any
            reduction but None). Its reduction, sample weights and the mask
            on the predictions are honoured as `fit` honours them, and the
            loss is that of one device on the global batch (see
            `loss_normalization`); the model's `losses` (regularizers,
            `add_loss`) are added once per step.
        strategy: the `tf.distribute.Strategy` to train under.
        batch: a `tfdp.BatchConfig`; `batch.num_replicas` must equal
            `strategy.num_replicas_in_sync`. The dataset yields global batches
            of `batch.global_batch` examples (or per-replica batches of
            `batch.replica_batch`, for a distributed dataset).
        metrics: Keras metric names or instances. Defaults to `None`.
        model_dir: where the chief writes checkpoints and TensorBoard
            summaries; `None` disables both (and resuming).
        steps_per_loop: optimizer steps per `tf.function` call; larger values
            cut Python overhead per step. Logging happens once per call.
            Defaults to 1.
        checkpoint_every: save a checkpoint every this many optimizer steps
            (and always at the end). `None` (default) saves only at the end.
        max_to_keep: checkpoints the chief keeps. Defaults to 3.
        jit_compile: compile each train step with XLA. Defaults to `False`.
        nonfinite: `"skip"`, `"raise"` or `None`: what a step with a
            non-finite loss or gradient does (see above). Defaults to
            `"skip"`.
        max_consecutive_nonfinite: with `"skip"`, stop after this many
            skipped steps in a row. Under `mixed_float16`, a skip counts
            toward it only once the loss scale is down to 1 (see
            `tfdp.training.nonfinite.NonFiniteLossScaleOptimizer`). Defaults to 10.
        save_on_sigterm: save and exit 42 on SIGTERM (needs `model_dir`).
            Defaults to `True`.
        all_reduce_dtype: `None` (default) sums gradients over replicas in
            their own dtype; `"bfloat16"` all-reduces half the bytes, each
            sum rounded to about 3 significant digits (`tfdp.distribute.reduction`).
            Not with `nonfinite=None`.
        gradient_compression: `None` (default): gradients are all-reduced
            as they are; `"bfloat16"`: summed in bfloat16 (the same as
            `all_reduce_dtype="bfloat16"`); `tfdp.compression.PowerSGD(...)`
            or `tfdp.compression.TopK(...)`: compressed with per-replica
            error feedback (see the README's communication section). A
            compressor acts only with more than one replica and needs
            `nonfinite` set.
        loss_normalization: `"global"` (default): the loss, its gradient
            and the logged loss are one device's on the whole global batch,
            for at most one all-reduce of a few scalars per step (none with
            a static batch and no mask); `"per_replica"`:
            each replica's mean, averaged, as stock Keras
            (`tfdp.training.loss_normalization`).
        sync_every: with more than 1, local SGD: each replica applies its
            own gradients (its loss normalised by its own counts) with no
            gradient all-reduce, and the replicas' weights are averaged every
            `sync_every` steps, at the end of every epoch, before
            evaluation, and at the end of `train`
            (`tfdp.distribute.local_sync`). A checkpoint does not
            synchronise: it saves every replica's weights and slots
            (`tfdp.training.replica_state`), so checkpoints never change the
            trajectory. Defaults to 1: synchronous.
        outer_optimizer: `None` (default), or a Keras optimizer for
            DiLoCo's outer step at each synchronisation (e.g.
            `keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)`, the
            paper's).
        overlap_sync: with True (and local steps: `sync_every > 1` or an
            `outer_optimizer`), each window's all-reduce runs in a
            background thread while the next window computes, and is
            applied one window late, each replica keeping its progress since
            (`tfdp.distribute.overlapped_sync`). Needs `steps_per_loop` dividing
            `sync_every`. Defaults to False.
        shard_optimizer_state: with True, ZeRO-1: each replica keeps the
            optimizer's slots (momentum, Adam's moments) for its 1/N share of
            every weight only, updates that share after the gradient all-reduce
            and all-gathers the updated weights
            (`tfdp.distribute.optimizer_sharding`). Needs an element-wise
            optimizer (not LARS, LAMB, clipnorm, use_ema) and `nonfinite` set;
            not with `sync_every > 1`. Defaults to False.
        balance_batches: `False` (default), `True` or a
            `tfdp.training.balanced_batches.BalanceOptions`: each replica
            computes a share of every global batch that follows its measured
            speed, re-planned every `replan_every` steps (after the training
            call in which they end), as `tfdp.compile`'s argument of that
            name says. The dataset must be a `tf.data.Dataset` (or a
            callable returning one) of global batches, the same on every
            worker: every replica reads each batch whole. Does nothing on one
            replica. `Trainer.balanced_batches` holds the plan.
        bucket_cap_mb: `None` (default), or MiB per gradient bucket, each
            all-reduced during the backward pass, as `tfdp.compile`'s
            argument of that name says.

    Raises:
        ValueError: an argument is invalid, two options cannot be combined
            (`tfdp.training.option_rules` names both and what to use
            instead), the batch does not match the strategy, or the model
            was not built in `strategy.scope()`.
    """

    def __init__(
        self,
        model: keras.Model,
        *,
        optimizer: keras.optimizers.Optimizer,
        loss,
        strategy: tf.distribute.Strategy,
        batch: BatchConfig,
        metrics: Sequence[Any] | None = None,
        model_dir: str | None = None,
        steps_per_loop: int = 1,
        checkpoint_every: int | None = None,
        max_to_keep: int = 3,
        jit_compile: bool = False,
        nonfinite: str | None = "skip",
        max_consecutive_nonfinite: int = nonfinite_lib.DEFAULT_MAX_CONSECUTIVE,
        save_on_sigterm: bool = True,
        all_reduce_dtype: str | None = None,
        loss_normalization: str = "global",
        gradient_compression=None,
        sync_every: int = 1,
        outer_optimizer=None,
        overlap_sync: bool = False,
        shard_optimizer_state: bool = False,
        balance_batches: bool | balanced_batches.BalanceOptions = False,
        bucket_cap_mb: float | None = None,
    ):
        # ParameterServerStrategy: the asynchronous path (its own outer loop).
        asynchronous = parameter_server.is_parameter_server(strategy)
        if asynchronous:
            parameter_server_loop.check_options(
                batch=batch, all_reduce_dtype=all_reduce_dtype,
                gradient_compression=gradient_compression, sync_every=sync_every,
                outer_optimizer=outer_optimizer, shard_optimizer_state=shard_optimizer_state,
                balance_batches=balance_batches, bucket_cap_mb=bucket_cap_mb)
        norm_lib.check_mode(loss_normalization)
        balance = balanced_batches.options_of(balance_batches)
        # On one replica there is nothing to balance: it does nothing.
        balancing = balance is not None and strategy.num_replicas_in_sync > 1
        all_reduce_dtype, compressor = compression.resolve(gradient_compression, all_reduce_dtype)
        if not isinstance(batch, BatchConfig):
            raise TypeError(
                f"`batch` must be a tfdp.BatchConfig, e.g. tfdp.BatchConfig.from_global("
                f"global_batch, strategy.num_replicas_in_sync). Received: batch={batch!r}"
            )
        if batch.num_replicas != strategy.num_replicas_in_sync:
            raise ValueError(
                f"`batch.num_replicas` ({batch.num_replicas}) must equal the strategy's "
                f"replicas in sync ({strategy.num_replicas_in_sync}). Build it with "
                f"tfdp.BatchConfig.from_global({batch.global_batch}, "
                f"{strategy.num_replicas_in_sync}, accum_steps={batch.accum_steps}) to keep "
                f"the global batch, or BatchConfig({batch.per_replica}, "
                f"{strategy.num_replicas_in_sync}, {batch.accum_steps}) to keep the "
                f"per-replica batch."
            )
        _checks.check_int("steps_per_loop", steps_per_loop)
        _checks.check_int("checkpoint_every", checkpoint_every, allow_none=True)
        _checks.check_int("max_to_keep", max_to_keep)
        local_sync_lib.check_sync_every(sync_every)
        local_sync_lib.check_overlap(overlap_sync)
        nonfinite_lib.check_values(nonfinite, max_consecutive_nonfinite, all_reduce_dtype,
                                   compressor, shard_optimizer_state)
        bucketed.check_bucket_cap_mb(bucket_cap_mb)
        # Every pair of options, before anything is built (tfdp.training.option_rules).
        option_rules.check(option_rules.TrainingOptions(
            nonfinite=nonfinite, all_reduce_dtype=all_reduce_dtype, compressor=compressor,
            sync_every=sync_every, outer_optimizer=outer_optimizer, overlap_sync=overlap_sync,
            shard_optimizer_state=shard_optimizer_state, accum_steps=batch.accum_steps,
            steps_per_execution=steps_per_loop,
            loss_scaling=keras.config.dtype_policy().name == "mixed_float16",
            jit_compile=jit_compile, optimizer=optimizer, balance_batches=balancing,
            bucket_cap_mb=bucket_cap_mb))
        if balancing:
            balanced_batches.check_loss_normalization(loss_normalization)
        local_sync = local_sync_lib.from_arguments(sync_every, outer_optimizer, overlap_sync)
        if jit_compile:
            devices.check_jit_compile_supported(strategy)
        shard_layout.check_sharded_exchange(  # reduce-scatter, or refuse now
            strategy, shard_optimizer_state=shard_optimizer_state, compressor=compressor,
            all_reduce_dtype=all_reduce_dtype)
        if not model.built or not model.trainable_variables:
            raise ValueError(
                "`model` must be built (give it an Input or call it once) and have "
                "trainable weights before it is handed to Trainer."
            )
        outside = [
            v.path for v in model.variables
            if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))
        ]
        if outside:
            raise ValueError(
                f"`model` was built outside `strategy.scope()` (e.g. variable "
                f"{outside[0]!r}). Create the model inside `with strategy.scope():`."
            )
        if isinstance(optimizer, str) or not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`optimizer` must be a keras.optimizers.Optimizer instance, e.g. "
                f"keras.optimizers.SGD(0.1). Received: optimizer={optimizer!r}"
            )

        self.model = model
        self.strategy = strategy
        self.batch = batch
        self.model_dir = model_dir
        self.steps_per_loop = steps_per_loop
        self.checkpoint_every = checkpoint_every
        self.info = strategy_info_lib.strategy_info(strategy)

        if not strategy.extended.variable_created_in_scope(
            getattr(optimizer.iterations, "value", optimizer.iterations)
        ):
            raise ValueError(
                "`optimizer` was created outside `strategy.scope()` (a Keras optimizer "
                "binds to the strategy current when it is constructed). Create it inside "
                "`with strategy.scope():`."
            )
        with strategy.scope():
            # Under mixed_float16, a LossScaleOptimizer whose replicas agree
            # on skipping a step (tfdp.training.nonfinite, every mode).
            optimizer = nonfinite_lib.wrap_optimizer(
                optimizer, nonfinite=nonfinite,
                max_consecutive_nonfinite=max_consecutive_nonfinite,
                loss_scaling=keras.config.dtype_policy().name == "mixed_float16",
                all_reduce_dtype=all_reduce_dtype, compressor=compressor,
                local_sync=local_sync, shard_optimizer_state=shard_optimizer_state,
                bucket_cap_mb=bucket_cap_mb,
            )
            optimizer.build(model.trainable_variables)
        self.optimizer = optimizer
        self._steps = replica_steps.ReplicaSteps(
            model=model, optimizer=optimizer, loss=loss, strategy=strategy, batch=batch,
            metrics=metrics, jit_compile=jit_compile, loss_normalization=loss_normalization,
            balance=balanced_batches.BalancedBatches(strategy, balance) if balancing else None,
        )
        #: The plan, timings and planner of balanced batches, or None.
        self.balanced_batches = self._steps.balance
        self._guard = nonfinite_lib.guard_of(optimizer)
        self._monitor = self._guard and step_monitor.StepMonitor(
            self._guard, owner="tfdp trainer", log=self.info.is_chief
        )
        self.save_on_sigterm = bool(save_on_sigterm)

        self._checkpoint = None
        self._checkpoints = None
        self._last_saved_step = None
        self._summary_writer = None
        # Full garbage collections would stall every worker in turn (see gc_freeze).
        self._heap = gc_freeze.FrozenHeap()
        self._epoch_position: dict[str, tf.Variable] | None = None
        if model_dir is not None:
            self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                                   **checkpointing.random_state(model))
            self._checkpoints = checkpointing.ChiefCheckpointManager(
                self._checkpoint, model_dir, is_chief=self.info.is_chief, max_to_keep=max_to_keep,
                replica_state=None if asynchronous else replica_state.ReplicaStateFiles(
                    model_dir, strategy, lambda: optimizer, max_to_keep=max_to_keep),
            )
            if self.info.is_chief:
                self._summary_writer = tf.summary.create_file_writer(os.path.join(model_dir, "train"))
        #: Under ParameterServerStrategy, the chief's asynchronous loop
        #: (`tfdp.training.parameter_server_loop.ParameterServerLoop`), else None.
        self.parameter_server_loop = (
            parameter_server_loop.ParameterServerLoop(self) if asynchronous else None)

    # --- public API -------------------------------------------------------

    @property
    def global_step(self) -> int:
        """Training steps (global batches) taken so far, skipped ones included.

        `optimizer.iterations` plus `skipped_steps`; restored with a
        checkpoint.
        """
        return int(self.optimizer.iterations.numpy()) + self.skipped_steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient (0 with `nonfinite=None`, but
        under `mixed_float16`, where overflowing steps are skipped and counted)."""
        if self._guard is None:
            return 0
        return int(keras.ops.convert_to_numpy(self._guard.skipped_steps))

    def restore(self) -> str | None:
        """Restores the latest checkpoint in `model_dir`, if any; returns its path."""
        if self._checkpoints is None:
            return None
        path = self._checkpoints.restore_latest()
        if path:
            self._last_saved_step = self.global_step
        return path

    def train(
        self,
        dataset: DatasetSource,
        *,
        steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
    ) -> dict:
        """Trains until `steps` training steps (or `epochs` epochs) in total.

        Resumes from the latest checkpoint in `model_dir` first, so running
        the same call again after an interruption (a crash, or the exit 42
        after a SIGTERM) finishes the same run.

        Args:
            dataset: a `tf.data.Dataset` of global batches, a distributed
                dataset, or a callable `epoch -> dataset` (either kind). The
                callable form resumes exactly mid-epoch: its order must depend
                only on its seed and `epoch`. A `pipelines.make_dataset`
                dataset with a `seed` (where its `streams_epochs` holds) gives
                epoch `e` an order of its own that depends only on the seed
                and `e`, and one iterator carries every epoch
                (`epoch_stream`). Any other plain dataset is iterated again
                each epoch, which resumes exactly only if it yields the same
                order every time. A resume enters the epoch at its
                batch: `pipelines.make_dataset`'s datasets seek there without
                reading the batches before; any other dataset reads (and a
                distributed one also copies) them, at most one epoch's worth
                (`tfdp.training.input_position`). A dataset of unknown size
                is trained epoch after epoch, each until it ends (with
                `steps`); an infinite one is a single epoch, so resuming it
                re-reads every batch since step 0: pass `steps_per_epoch`
                with a callable to bound that.
            steps: total training steps (global batches, skipped ones
                included) to reach, counting restored ones.
            epochs: total epochs to reach; needs `steps_per_epoch` or a
                dataset of known cardinality.
            steps_per_epoch: training steps per epoch. Defaults to the
                dataset's cardinality.

        Returns:
            `{"loss", <metric names>..., "steps", "epochs", "skipped_steps",
            "examples_per_second"}`: metrics over the last epoch's steps run
            by this call (a skipped step's NaN loss included), totals, and
            this call's throughput.

        Raises:
            ValueError: neither or both of `steps` / `epochs`, the steps
                per epoch cannot be determined, or the dataset's first batch
                is not `batch.global_batch` examples (`batch.replica_batch`
                per replica for a distributed dataset; see
                `tfdp.training.batch.check_first_batch`).
            tfdp.training.nonfinite.NonFiniteError: `max_consecutive_nonfinite` steps
                in a row were not finite, or a checkpoint would have held
                non-finite weights (none is written).
            SystemExit: with status 42, after the checkpoint saved on SIGTERM.
        """
        if (steps is None) == (epochs is None):
            raise ValueError(
                "Pass exactly one of `steps` (total training steps) or `epochs`. "
                f"Received: steps={steps!r}, epochs={epochs!r}"
            )
        _checks.check_int("steps", steps, allow_none=True)
        _checks.check_int("epochs", epochs, allow_none=True)
        _checks.check_int("steps_per_epoch", steps_per_epoch, allow_none=True)
        dataset_for_epoch = dataset if callable(dataset) and not isinstance(
            dataset, (tf.data.Dataset, tf.distribute.DistributedDataset)
        ) else (lambda epoch: dataset)
        until_end = False
        if steps_per_epoch is None:
            steps_per_epoch = batch_lib.num_batches(dataset_for_epoch(0))
        if steps_per_epoch < 1:  # unknown, infinite or empty
            if epochs is not None:
                raise ValueError(
                    "The dataset's number of batches is unknown or infinite, so "
                    "`epochs` cannot be counted. Pass steps_per_epoch=..."
                )
            # Unknown: an epoch lasts until the dataset ends. Infinite: the
            # whole run is one epoch.
            until_end = steps_per_epoch == batch_lib.UNKNOWN
            steps_per_epoch = steps
        total_steps = steps if steps is not None else epochs * steps_per_epoch
        if until_end:
            self._track_epochs()  # before restoring: the checkpoint holds them

        restored = self.restore()
        global_step = self.global_step
        if self.info.is_chief:
            logging.info("tfdp trainer: %s", self.info.describe())
            logging.info("tfdp trainer: %s", self.batch.describe())
            if restored:
                logging.info("tfdp trainer: resumed from %s at step %d", restored, global_step)
        if self._summary_writer is not None and global_step == 0:
            with self._summary_writer.as_default(step=0):
                summaries.write_batch_layout(self.batch)

        watcher = self._start_watching_sigterm()
        if self.balanced_batches is not None:
            self.balanced_batches.begin()
        try:
            self._heap.start()
            if self.parameter_server_loop is not None:
                if until_end:
                    raise ValueError(
                        "Under ParameterServerStrategy the dataset is repeated on every "
                        "worker, so an epoch of unknown size cannot end: pass steps_per_epoch.")
                logs = self.parameter_server_loop.train(
                    dataset, global_step, total_steps, steps_per_epoch)
            elif until_end:
                logs = self._train_epochs_until_end(dataset_for_epoch, global_step, total_steps)
            else:
                # make_dataset(..., seed=...): one iterator over every epoch.
                stream = dataset if getattr(dataset, "streams_epochs", False) else None
                logs = self._train_steps(
                    dataset_for_epoch, global_step, total_steps, steps_per_epoch, stream=stream)
        finally:
            self._heap.stop()
            if watcher is not None:
                watcher.stop()
        return logs

    def _track_epochs(self) -> None:
        """Adds the epoch and the step it began at to the checkpoint (unknown-size input)."""
        if self._epoch_position is None:
            with tf.init_scope():  # plain variables: every worker holds the same values
                self._epoch_position = {
                    name: tf.Variable(0, dtype=tf.int64, trainable=False, name=name)
                    for name in ("epoch", "epoch_start")
                }
        if self._checkpoint is not None and not hasattr(self._checkpoint, "input_position"):
            self._checkpoint.input_position = tf.train.Checkpoint(**self._epoch_position)

    def _train_epochs_until_end(self, dataset_for_epoch, global_step, total_steps) -> dict:
        """The loop for a dataset of unknown size: each epoch runs until the dataset ends.

        The epoch and the step it began at are checkpointed, so a resume
        enters the current epoch at `global_step - epoch_start` and skips at
        most that epoch's batches.
        """
        start_step, start_time = global_step, time.perf_counter()
        if self._monitor is not None:
            self._monitor.prime()
        position = self._epoch_position
        if global_step == 0:
            position["epoch"].assign(0)
            position["epoch_start"].assign(0)
        logs: dict = {}
        checked = False
        while global_step < total_steps:
            epoch = int(position["epoch"].numpy())
            offset = global_step - int(position["epoch_start"].numpy())
            dataset = dataset_for_epoch(epoch)
            if not checked:
                batch_lib.check_first_batch(dataset, self.batch, owner="tfdp Trainer")
                checked = True
            iterator = self._steps.distribute(dataset, offset)
            self._reset(self._steps.train_loss, *self._steps.train_metrics)
            ran_this_epoch = 0
            while global_step < total_steps:
                num = total_steps - global_step
                num = min(self.steps_per_loop, num)
                if self.checkpoint_every:
                    num = min(num, self.checkpoint_every - global_step % self.checkpoint_every)
                loop_start = time.perf_counter()
                self.train_loop_begin()
                ran = int(self._steps.train_loop_until_end(iterator, tf.constant(num)))
                self._after_call()
                self.train_loop_end()
                self._after_steps(ran)
                if ran:
                    logs = self._results(self._steps.train_loss, self._steps.train_metrics)
                    self._heap.mark("train")  # what the first call traced
                    elapsed = time.perf_counter() - loop_start
                    global_step += ran
                    ran_this_epoch += ran
                    if self._monitor is not None:
                        self._check_steps(self._monitor.check(), global_step)
                    self._log_progress(global_step, total_steps, logs,
                                       ran * self.batch.global_batch / elapsed)
                    if self.checkpoint_every and global_step % self.checkpoint_every == 0:
                        self._save(global_step)
                    self._position = global_step
                    if self._watcher is not None:
                        self._watcher.step_end()
                if ran < num:  # the dataset ended: the next epoch begins here
                    if not ran_this_epoch and not offset:
                        raise ValueError(
                            f"tfdp Trainer: dataset({epoch}) yielded no batch. Every epoch of "
                            f"a dataset of unknown size must hold at least one global batch.")
                    self._sync_pending()
                    position["epoch"].assign(epoch + 1)
                    position["epoch_start"].assign(global_step)
                    break
        self._sync_pending()
        if self._checkpoints is not None and global_step > start_step:
            self._save(global_step)
        elapsed = time.perf_counter() - start_time
        trained = global_step - start_step
        return {
            **logs,
            "steps": global_step,
            "epochs": float(position["epoch"].numpy()),
            "skipped_steps": self.skipped_steps,
            "examples_per_second": trained * self.batch.global_batch / elapsed if trained else 0.0,
        }

    def _train_steps(self, dataset_for_epoch, global_step, total_steps, steps_per_epoch, *,
                     stream=None) -> dict:
        """The loop for epochs of a known number of steps.

        Each epoch iterates `dataset_for_epoch(epoch)`, entered at the
        position; with `stream` (a dataset whose `epoch_stream` carries every
        epoch in one dataset, `pipelines.make_dataset`'s), one iterator over
        the stream from the position on serves every epoch instead.
        """
        start_step, start_time = global_step, time.perf_counter()
        if self._monitor is not None:
            self._monitor.prime()
        logs: dict = {}
        checked = False
        iterator = None
        while global_step < total_steps:
            epoch, offset = divmod(global_step, steps_per_epoch)
            dataset = stream if stream is not None else dataset_for_epoch(epoch)
            if not checked:  # before the first step: nothing trained or written yet
                batch_lib.check_first_batch(dataset, self.batch, owner="tfdp Trainer")
                checked = True
            if stream is None:
                iterator = self._steps.distribute(dataset, offset)
            elif iterator is None:  # each epoch below runs to its end: the stream goes on
                iterator = self._steps.distribute(
                    stream.epoch_stream(epoch, offset, steps_per_epoch=steps_per_epoch), 0)
            self._reset(self._steps.train_loss, *self._steps.train_metrics)
            while offset < steps_per_epoch and global_step < total_steps:
                num = min(self.steps_per_loop, steps_per_epoch - offset, total_steps - global_step)
                if self.checkpoint_every:
                    num = min(num, self.checkpoint_every - global_step % self.checkpoint_every)
                loop_start = time.perf_counter()
                self.train_loop_begin()
                self._steps.train_loop(iterator, tf.constant(num))
                self._after_call()
                if offset + num == steps_per_epoch:
                    self._sync_pending()  # an epoch's last steps end a local window
                self.train_loop_end()
                logs = self._results(self._steps.train_loss, self._steps.train_metrics)  # syncs
                self._heap.mark("train")  # what the first call traced
                elapsed = time.perf_counter() - loop_start
                self._after_steps(num)
                offset += num
                global_step += num
                if self._monitor is not None:
                    # Raises at the limit, before anything is saved.
                    self._check_steps(self._monitor.check(), global_step)
                self._log_progress(global_step, total_steps, logs, num * self.batch.global_batch / elapsed)
                if self.checkpoint_every and global_step % self.checkpoint_every == 0:
                    self._save(global_step)
                self._position = global_step
                if self._watcher is not None:  # every worker, after every call
                    self._watcher.step_end()
        self._sync_pending()
        if self._checkpoints is not None and global_step > start_step:
            self._save(global_step)  # unless already saved at this step
        elapsed = time.perf_counter() - start_time
        trained = global_step - start_step
        return {
            **logs,
            "steps": global_step,
            "epochs": global_step / steps_per_epoch,
            "skipped_steps": self.skipped_steps,
            "examples_per_second": trained * self.batch.global_batch / elapsed if trained else 0.0,
        }

    def evaluate(self, dataset: DatasetLike) -> dict:
        """Evaluates on every example of `dataset` once.

        Metrics are aggregated over all replicas and workers and weighted by
        `sample_weight` when the dataset yields one (padding examples with
        weight 0 are ignored exactly).

        Args:
            dataset: a finite `tf.data.Dataset` of global batches or a
                distributed dataset; under MultiWorkerMirroredStrategy every
                worker must yield the same number of batches.

        Returns:
            `{"loss": mean per-example loss, <metric names>: results}`.
        """
        if self.parameter_server_loop is not None:
            return self.parameter_server_loop.evaluate(dataset)
        # As in train: a full garbage collection on one worker stalls the others.
        with gc_freeze.FrozenHeap():
            self._sync_pending(training=False)
            self._reset(self._steps.eval_loss, *self._steps.eval_metrics)
            if isinstance(dataset, tf.data.Dataset):
                dataset = self.strategy.experimental_distribute_dataset(dataset)
            for data in dataset:
                self._steps.eval_step(data)
            return self._results(self._steps.eval_loss, self._steps.eval_metrics)

    # --- hooks --------------------------------------------------------------

    def train_loop_begin(self) -> None:
        """Called before each training call of up to `steps_per_loop` steps; does nothing.

        Override it in a subclass (or assign a function of no arguments to it
        on one trainer) to act between calls, as Orbit's
        `StandardTrainer.train_loop_begin` (the benchmark marks the time here).
        It runs on every worker; a collective in it must run on all of them.
        """

    def train_loop_end(self) -> None:
        """Called after each training call, before its metrics are read; does nothing.

        Override it as `train_loop_begin`, as Orbit's `StandardTrainer.train_loop_end`.
        `global_step` already counts the call's steps. It runs on every worker.
        """

    # --- outer-loop helpers -------------------------------------------------

    @staticmethod
    def _reset(*metrics):
        for metric in metrics:
            metric.reset_state()

    @staticmethod
    def _results(loss_metric, metrics) -> dict:
        results = {"loss": float(loss_metric.result())}
        for metric in metrics:
            value = metric.result()
            if isinstance(value, dict):
                results.update({k: float(v) for k, v in value.items()})
            else:
                results[metric.name] = float(value)
        return results

    def _learning_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self.optimizer.learning_rate))

    def _log_progress(self, step: int, total: int, logs: dict, examples_per_second: float):
        if not self.info.is_chief:
            return
        lr = self._learning_rate()
        logging.info(
            "step %d/%d: %s, lr %.4g, %.0f examples/s",
            step, total, ", ".join(f"{k} {v:.4f}" for k, v in logs.items()), lr,
            examples_per_second,
        )
        if self._summary_writer is not None:
            with self._summary_writer.as_default(step=step):
                summaries.write_progress(
                    logs, learning_rate=lr, examples_per_second=examples_per_second,
                    skipped_steps=self.skipped_steps if self._guard is not None else None)

    def _after_steps(self, steps: int) -> None:
        """After a training call: balanced batches re-plan when their steps are due."""
        if self.balanced_batches is not None and steps:
            self.balanced_batches.after_steps(steps, log=self.info.is_chief)

    def _check_steps(self, counted: int, expected: int) -> None:
        """Checks that the optimizer counted every step this worker ran."""
        if counted != expected:
            raise RuntimeError(
                f"tfdp trainer: after {expected} training steps the optimizer counts "
                f"{counted} (optimizer.iterations + skipped_steps). Was the optimizer "
                f"stepped outside this Trainer, or shared with another model?"
            )

    def _start_watching_sigterm(self):
        """Starts the save-and-exit on SIGTERM, if asked for; returns the watcher."""
        self._watcher = None
        self._position = self.global_step
        if not self.save_on_sigterm or self._checkpoints is None:
            return None
        self._watcher = preemption.PreemptionWatcher(
            strategy=self.strategy,
            checkpoint=self._checkpoint,
            directory=self.model_dir,
            save_fn=lambda: self._save(self._position),
            owner="tfdp trainer",
        )
        with self._checkpoints.restoring_elsewhere():
            self._watcher.start()
        self._checkpoints.restore_replica_state_again()  # the handler restored the chief's
        return self._watcher

    def _sync_pending(self, *, training: bool = True) -> None:
        """With local steps (sync_every, outer_optimizer), synchronises the weights if they differ.

        Raises:
            NonFiniteError: while `training`, the workers agreed at this
                synchronisation to stop (a replica reached
                `max_consecutive_nonfinite`).
        """
        if self._guard is not None:
            self._guard.sync_pending()
            if training and self._guard.steps_locally:
                self._monitor.check()

    def _after_call(self) -> None:
        """After each training call: overlapped local steps end their windows here."""
        if self._guard is not None:
            self._guard.after_call()

    def _save(self, step: int):
        """Saves the checkpoint of `step` (a collective: every worker calls it)."""
        if self._checkpoints is None or step == self._last_saved_step:
            return  # no model_dir (checkpoint_every alone saves nothing), or saved
        if self._guard is not None:
            self._guard.quiesce()  # no all-reduce in flight while the save runs its own
        # No synchronisation first (local steps): every worker's replicas save
        # their own weights (tfdp.training.replica_state), so a save does not
        # end a window and the trajectory is that of a run without saves.
        # Every worker holds the same weights, so all refuse alike.
        step_monitor.check_finite_before_save(
            [*self.model.weights, *self.optimizer.variables], step=step,
            owner="tfdp trainer", last_saved=self._checkpoints.latest_checkpoint,
        )
        path = self._checkpoints.save(step)
        self._last_saved_step = step
        if path:
            logging.info("tfdp trainer: saved %s", path)
