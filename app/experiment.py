"""One training run from a `RunConfig`: `train_and_evaluate`.

This module owns the sequence of a run (validate batch against the planned
replicas, build the strategy, data, model and optimiser, train with
`model.fit` or `tfdp.Trainer`, evaluate, write `summary.json`), the start-up
line the chief prints, and which phase of the run each second goes to (the
clock itself is `tfdp.app.phase_clock`'s). It does not know where data or models come
from: the caller passes `build_dataset` and `build_model` (the `tfdp-train`
entry point wires in `pipelines` and `models`), so `tfdp` stays independent of
both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Protocol

import keras
import tensorflow as tf

from tfdp.training import fit_compile
from tfdp.training import checkpointing
from tfdp.callbacks import BackupAndRestore
from tfdp.training import lr_schedules
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training import replica_state
from tfdp import optimizers as tfdp_optimizers
from tfdp import pipelines
from tfdp.distribute import config_check
from tfdp.distribute import strategy as strategy_lib
from tfdp.distribute import devices
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.training.batch import BatchConfig
from tfdp.app import run_summaries
from tfdp.app.phase_clock import PhaseClock
from tfdp.app.run_config import ConfigError
from tfdp.app.run_config import RunConfig
from tfdp.training.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What the run needs to know about a dataset to build the model and schedule.

    Attributes:
        input_shape: one example's feature shape, without the batch axis.
        num_classes: label classes.
        steps_per_epoch: optimizer steps (global batches) per epoch.
        num_examples: examples in the split.
        split: the dataset's split this is, e.g. `"test"` for `EVAL`.
            Defaults to None (not said).
        model_arguments: model builder arguments that follow from the data
            (e.g. `{"vocab_size": 1000}`), passed to `build_model`.
    """

    input_shape: tuple
    num_classes: int
    steps_per_epoch: int
    num_examples: int
    split: str | None = None
    model_arguments: dict = dataclasses.field(default_factory=dict)


#: What `train_and_evaluate` asks `build_dataset` for: the training data, and
#: the evaluation data (the builder picks the split: `--eval_split`).
TRAIN = "train"
EVAL = "eval"


class BuildDataset(Protocol):
    def __call__(self, role: str, *, training: bool, strategy: tf.distribute.Strategy,
                 batch: BatchConfig, seed: int) -> tuple[Any, DatasetSpec]:
        """Returns the dataset for `role` (`TRAIN` or `EVAL`; global batches per
        step) and its spec, whose `split` says which split it read."""


BuildModel = Callable[..., keras.Model]  # (name, *, input_shape, num_classes, **args) -> model

#: Step decay: the learning rate is multiplied by this at 50% and 75% of training.
STEP_DECAY_RATE = 0.1


def batch_config(config: RunConfig, num_replicas: int) -> BatchConfig:
    """The run's batch arithmetic; errors name the flag that needs changing."""
    if config.global_batch is not None:
        try:
            return BatchConfig.from_global(config.global_batch, num_replicas, config.accum_steps)
        except ValueError as error:
            raise ConfigError(f"--global_batch: {error}") from None
    return BatchConfig(config.per_replica_batch, num_replicas, config.accum_steps)


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffling seed of `epoch`: each epoch's order depends only on (seed, epoch)."""
    return seed * 100_003 + epoch


def learning_rate_schedule(config: RunConfig, batch: BatchConfig, steps_per_epoch: int):
    """The scaled peak learning rate and its warmup/decay schedule (optimizer steps)."""
    base_batch = config.base_batch or batch.global_batch
    peak = lr_schedules.scale_lr(config.base_lr, base_batch, batch.global_batch, config.lr_scaling)
    total = config.epochs * steps_per_epoch
    warmup = config.warmup_steps
    if warmup is None:
        warmup = round((config.warmup_epochs or 0) * steps_per_epoch)
    warmup = min(warmup, total - 1)
    kwargs: dict = {}
    if config.decay in ("cosine", "poly"):
        kwargs["total_steps"] = total
    elif config.decay == "step":
        boundaries = sorted({max(warmup, 1, round(total * f)) for f in (0.5, 0.75)})
        kwargs.update(decay_boundaries=[b for b in boundaries if b < total] or [total - 1],
                      decay_rate=STEP_DECAY_RATE)
    schedule = lr_schedules.WarmupSchedule(peak, warmup_steps=warmup, decay=config.decay, **kwargs)
    return peak, schedule


def make_optimizer(config: RunConfig, learning_rate) -> keras.optimizers.Optimizer:
    """The `--optimizer` with `--weight_decay`; call inside `strategy.scope()`."""
    decay = config.weight_decay or None
    if config.optimizer == "sgd":
        return keras.optimizers.SGD(learning_rate, weight_decay=decay)
    if config.optimizer == "momentum":
        return keras.optimizers.SGD(learning_rate, momentum=0.9, weight_decay=decay)
    if config.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate, weight_decay=decay)
    if config.optimizer == "adamw":
        return keras.optimizers.AdamW(learning_rate, weight_decay=config.weight_decay)
    if config.optimizer == "lars":
        return tfdp_optimizers.LARS(learning_rate, momentum=0.9, weight_decay=config.weight_decay)
    return tfdp_optimizers.LAMB(learning_rate, weight_decay=config.weight_decay)


class _EpochTimer(keras.callbacks.Callback):
    """Wall time and optimizer steps of each epoch `fit` runs (a resumed one runs fewer)."""

    def __init__(self):
        super().__init__()
        self.epochs: list[tuple[float, int]] = []  # (seconds, steps)

    def _state(self):
        return time.perf_counter(), _training_steps(self.model.optimizer)

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._state()

    def on_epoch_end(self, epoch, logs=None):
        now, steps = self._state()
        self.epochs.append((now - self._start[0], steps - self._start[1]))


class _PhaseTimer(keras.callbacks.Callback):
    """Charges `fit`'s training calls and epochs to a `PhaseClock`.

    Each batch interval (one execution of `steps_per_execution` steps) is a
    training call; an epoch runs from its `on_epoch_begin` to its
    `on_epoch_end`. Put it last in `fit`'s callbacks, so that an epoch's end
    includes the other callbacks' (the backup's save).
    """

    def __init__(self, clock: PhaseClock):
        super().__init__()
        self._clock = clock

    def on_epoch_begin(self, epoch, logs=None):
        self._clock.epoch_begin(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._clock.epoch_end()

    def on_train_batch_begin(self, batch, logs=None):
        self._clock.step_begin()

    def on_train_batch_end(self, batch, logs=None):
        self._clock.step_end()


def _floats(logs: dict) -> dict:
    return {k: float(v) for k, v in logs.items()}


def train_and_evaluate(
    config: RunConfig, *, build_dataset: BuildDataset, build_model: BuildModel,
    clock: PhaseClock | None = None,
) -> dict:
    """Trains `config.model` on `config.dataset` data-parallel, then evaluates.

    Every worker calls it; only the chief logs progress and writes
    `model_dir/summary.json`.

    Args:
        config: the run's options (already validated on construction).
        build_dataset: builds the training (`TRAIN`) or evaluation (`EVAL`)
            dataset and its `DatasetSpec`.
        build_model: `(name, *, input_shape, num_classes, **model_arguments)
            -> keras.Model`, logits out; `model_arguments` are the training
            `DatasetSpec`'s.
        clock: where the run's phases are timed (`tfdp.app.phase_clock`);
            `tfdp-train` passes one that started with the process and holds
            its imports and checks. Defaults to a new one started now.

    Returns:
        The summary: `train` and `eval` metrics, `eval_split`, `model`, `batch`, `steps`,
        `examples_per_second`, `wall_time_seconds`, `learning_rate`,
        `strategy`, `config`, and `phases` (`PhaseClock.summary()`: seconds by
        phase, build and step counts, one row per epoch; the chief also
        prints them in its last line).

    Raises:
        ConfigError: the batch does not divide over the replicas, or
            `--steps_per_epoch` exceeds the data, or `--loop=fit` was asked to
            continue a run in a `model_dir` that holds a checkpoint.
    """
    start = time.perf_counter()
    clock = clock if clock is not None else PhaseClock()
    clock.begin("strategy")
    strategy_options = dict(
        cpu_replicas=config.cpu_replicas, cross_device_ops=config.cross_device_ops,
        communication=config.communication, bytes_per_pack=config.bytes_per_pack,
        timeout_seconds=config.collective_timeout, memory_growth=config.gpu_memory_growth,
    )
    try:
        plan = strategy_lib.plan_from_environment(config.strategy, **strategy_options)
    except ValueError as error:  # contradicts the cluster or the hardware
        raise ConfigError(str(error)) from None
    batch = batch_config(config, plan.num_replicas)  # before any collective starts
    if config.mixed_precision != "none":
        keras.config.set_dtype_policy(config.mixed_precision)
    strategy = strategy_lib.make_strategy(config.strategy, **strategy_options)
    config_check.check_same_config(strategy, config.to_dict())  # every worker, same flags
    info = strategy_info_lib.strategy_info(strategy)
    if config.jit_compile:
        try:
            devices.check_jit_compile_supported(strategy)
        except ValueError as error:
            raise ConfigError(f"--jit_compile: {error}") from None
    clock.end("strategy")
    build_dataset = _timed_builds(build_dataset, clock)

    train_data, spec = build_dataset(
        TRAIN, training=True, strategy=strategy, batch=batch, seed=epoch_seed(config.seed, 0)
    )
    steps_per_epoch = config.steps_per_epoch or spec.steps_per_epoch
    if steps_per_epoch > spec.steps_per_epoch:
        raise ConfigError(
            f"--steps_per_epoch={config.steps_per_epoch} exceeds the {spec.steps_per_epoch} "
            f"global batches of {batch.global_batch} in the {spec.num_examples} training "
            f"examples. Lower it, or leave it unset to use the whole split."
        )
    peak_lr, schedule = learning_rate_schedule(config, batch, steps_per_epoch)
    with clock.phase("model"), strategy.scope():
        keras.utils.set_random_seed(config.seed)
        model = build_model(config.model, input_shape=spec.input_shape,
                            num_classes=spec.num_classes, **spec.model_arguments)
        optimizer = make_optimizer(config, schedule)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if info.is_chief:
        print(f"tfdp-train: {info.describe()}")
        print(f"tfdp-train: {batch.describe()}")
        print(
            f"tfdp-train: {config.optimizer}, learning rate {config.base_lr:g} at batch "
            f"{config.base_batch or batch.global_batch} -> {peak_lr:.6g} at {batch.global_batch} "
            f"({config.lr_scaling} scaling), warmup {schedule.warmup_steps} steps, "
            f"{config.decay} decay; {config.epochs} epochs x {steps_per_epoch} steps",
            flush=True,
        )
        if config.balance_batches and plan.num_replicas > 1:
            print(f"tfdp-train: balanced batches: every worker reads each global batch of "
                  f"{batch.global_batch} whole and computes a share that follows its measured "
                  f"speed (equal at first, re-planned every 20 steps)", flush=True)

    unused = [train_data]

    def dataset_for_epoch(epoch: int):
        # A fresh dataset per call: iterating one distributed dataset twice
        # (Keras' first peek, then the epoch) does not give a reproducible
        # order, and a resumed run must see exactly the batches the straight
        # run saw. `train_data` is handed out once, for epoch 0.
        if epoch == 0 and unused:
            data = unused.pop()
        else:
            data = build_dataset(TRAIN, training=True, strategy=strategy, batch=batch,
                                 seed=epoch_seed(config.seed, epoch))[0]
        # build_dataset may only plan it (for a run that streams its epochs).
        return data.distribute() if isinstance(data, pipelines.PlannedDataset) else data

    # One dataset for every epoch where the pipeline can carry them all
    # (make_dataset's epoch_stream): one iterator for the whole run, no
    # pipeline build, iterator or iterator teardown per epoch.
    stream = train_data if getattr(train_data, "streams_epochs", False) else None
    if stream is not None:
        stream.epoch_stream = _timed_stream(stream.epoch_stream, clock)
    train_started = time.perf_counter()
    clock.begin("outside_steps")  # what the steps and the rebuilds leave of training
    if config.loop == "fit":
        train_logs, examples_per_second = _train_with_fit(
            config, model, optimizer, loss, batch, dataset_for_epoch, steps_per_epoch, info,
            clock, stream=stream,
        )
        eval_model = model
        steps = _training_steps(model.optimizer)
        balance = getattr(model, "tfdp_balanced_batches", None)
    else:
        trainer = Trainer(
            model, optimizer=optimizer, loss=loss, strategy=strategy, batch=batch,
            metrics=["accuracy"], model_dir=config.model_dir,
            # An overlapped window ends between calls: they must divide it.
            steps_per_loop=steps_per_execution_for(config.steps_per_loop, None, None,
                                                   _overlapped_window(config)),
            checkpoint_every=config.checkpoint_every,
            jit_compile=config.jit_compile, all_reduce_dtype=config.all_reduce_dtype,
            loss_normalization=config.loss_normalization,
            gradient_compression=config.gradient_compression_argument(),
            sync_every=config.sync_every, outer_optimizer=config.outer_optimizer_argument(),
            overlap_sync=config.overlap_sync,
            shard_optimizer_state=config.shard_optimizer_state,
            balance_batches=config.balance_batches, bucket_cap_mb=config.bucket_cap_mb,
        )
        if trainer.balanced_batches is not None:  # the plan in examples from the first step
            trainer.balanced_batches.set_global_batch(batch.global_batch)
        # The Trainer's hooks around each training call; an epoch runs from
        # the call for its dataset to the next one's (or the end).
        trainer.train_loop_begin = clock.step_begin
        trainer.train_loop_end = clock.step_end

        if stream is None:
            def epoch_dataset(epoch: int):
                clock.epoch_begin(epoch)
                return dataset_for_epoch(epoch)

            train_input = epoch_dataset
        else:  # no call per epoch: an epoch begins with the call that enters it
            def loop_begin():
                epoch = trainer.global_step // steps_per_epoch
                if epoch != clock.current_epoch:
                    clock.epoch_begin(epoch)
                clock.step_begin()

            trainer.train_loop_begin = loop_begin
            train_input = stream
        result = trainer.train(train_input, epochs=config.epochs,
                               steps_per_epoch=steps_per_epoch)
        clock.epoch_end()
        examples_per_second = result.pop("examples_per_second")
        steps = int(result.pop("steps"))
        result.pop("epochs")
        train_logs = result
        eval_model = trainer
        balance = trainer.balanced_batches
    train_seconds = time.perf_counter() - train_started
    clock.end("outside_steps")

    eval_logs: dict = {}
    eval_split = None
    if config.eval:
        with clock.phase("final_eval"):
            eval_data, eval_spec = build_dataset(EVAL, training=False, strategy=strategy,
                                                 batch=batch, seed=config.seed)
            eval_split = eval_spec.split
            if config.loop == "fit":
                eval_logs = _floats(eval_model.evaluate(eval_data, return_dict=True, verbose=0))
            else:
                eval_logs = _floats(eval_model.evaluate(eval_data))
    clock.begin("outputs")
    outputs = {}
    if config.model_dir and info.is_chief:
        if eval_logs:
            run_summaries.write_eval_scalars(config.model_dir, steps, eval_logs)
        outputs = {
            "tensorboard": {name: os.path.join(config.model_dir, name)
                            for name in (run_summaries.TRAIN_DIR, run_summaries.EVAL_DIR)
                            if os.path.isdir(os.path.join(config.model_dir, name))},
            "curves": run_summaries.plot_curves(config.model_dir, steps_per_epoch=steps_per_epoch),
        }
    summary = {
        "train": _floats(train_logs),
        "eval": eval_logs,
        "eval_split": eval_split,
        # What tfdp-predict rebuilds the model from.
        "model": {"name": config.model, "input_shape": list(spec.input_shape),
                  "num_classes": spec.num_classes, "arguments": dict(spec.model_arguments)},
        **outputs,
        "batch": {
            "per_replica": batch.per_replica, "replicas": batch.num_replicas,
            "accum_steps": batch.accum_steps, "global": batch.global_batch,
        },
        "steps": steps,
        "steps_per_epoch": steps_per_epoch,
        # --balance_batches: each worker's share at the end and every plan adopted.
        "balanced_batches": None if balance is None else {
            "shares": [int(s) for s in balance.plan.numpy()],
            "plans": [[int(step), list(shares)] for step, shares in balance.history]},
        "examples_per_second": examples_per_second,
        "train_seconds": train_seconds,
        "wall_time_seconds": time.perf_counter() - start,
        "learning_rate": peak_lr,
        "strategy": dataclasses.asdict(info),
        "config": config.to_dict(),
    }
    if info.is_chief:
        print("tfdp-train: train " + ", ".join(f"{k} {v:.4f}" for k, v in summary["train"].items()))
        if eval_logs:
            print("tfdp-train: eval " + ", ".join(f"{k} {v:.4f}" for k, v in eval_logs.items()))
        print(f"tfdp-train: {steps} steps, {examples_per_second:.0f} examples/s, "
              f"{summary['wall_time_seconds']:.1f} s", flush=True)
        if config.model_dir:
            os.makedirs(config.model_dir, exist_ok=True)
    clock.end("outputs")  # summary.json's own write is the only part after this
    summary["phases"] = clock.summary()
    if info.is_chief:
        if config.model_dir:
            with open(os.path.join(config.model_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2, default=str)
        print(f"tfdp-train: time by phase: {clock.describe(summary['phases'])}", flush=True)
    return summary


def _timed_builds(build_dataset: BuildDataset, clock: PhaseClock) -> BuildDataset:
    """`build_dataset`, each call charged to `pipeline_builds` and counted by role."""

    def build(role, **kwargs):
        clock.count(f"{role}_pipeline_builds")
        with clock.phase("pipeline_builds"):
            return build_dataset(role, **kwargs)

    return build


def _timed_stream(epoch_stream, clock: PhaseClock):
    """`epoch_stream`, each call a train pipeline build (charged and counted)."""

    def build(*args, **kwargs):
        clock.count(f"{TRAIN}_pipeline_builds")
        with clock.phase("pipeline_builds"):
            return epoch_stream(*args, **kwargs)

    return build


def steps_per_execution_for(
    steps_per_loop: int, steps_per_epoch: int | None, checkpoint_every: int | None = None,
    overlapped_window: int | None = None,
) -> int:
    """The largest divisor of `steps_per_epoch`, `checkpoint_every` and
    `overlapped_window` <= `steps_per_loop`.

    Keras' epoch iterator runs whole executions and calls batch callbacks
    once per execution. With an explicit `steps_per_epoch` shorter than the
    data, an execution that does not divide it overruns the epoch (5 steps
    per epoch at 2 per execution run 6); a backup every `checkpoint_every`
    steps can only land at the end of an execution. Either may be `None`
    (no constraint): an epoch that ends with the data may end part-way
    through an execution. An overlapped window (`--overlap_sync`: its
    `--sync_every`) ends between executions, so they must divide it too.
    """
    constraints = [n for n in (steps_per_epoch, checkpoint_every, overlapped_window) if n]
    if not constraints:
        return steps_per_loop
    common = math.gcd(*constraints)
    return max(d for d in range(1, min(steps_per_loop, common) + 1) if common % d == 0)


def _overlapped_window(config: RunConfig) -> int | None:
    """`--sync_every` when windows overlap (`--overlap_sync`), else None."""
    return config.sync_every if config.overlap_sync else None


def _training_steps(optimizer) -> int:
    """Training steps (global batches) taken: `optimizer.iterations` counts applied
    updates only, so steps skipped for a non-finite loss or gradient are added back
    (`Trainer.global_step`'s count)."""
    guard = nonfinite_lib.guard_of(optimizer)
    # The guard's counters exist once the optimizer is built (fit builds it on
    # its first step, after on_train_begin); none skipped before that.
    counter = None if guard is None else getattr(guard, "skipped_steps", None)
    skipped = 0 if counter is None else int(keras.ops.convert_to_numpy(counter))
    return int(optimizer.iterations.numpy()) + skipped


def _final_checkpoint(config, model, info) -> checkpointing.ChiefCheckpointManager:
    """Where `--loop=fit` keeps its final weights and optimizer: `model_dir`.

    With every worker's per-replica state beside it (sharded optimizer
    state, error-feedback memories, local slots), as `--loop=custom` keeps
    its checkpoints: the chief's checkpoint alone holds replica 0's only.
    """
    return checkpointing.ChiefCheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                            **checkpointing.random_state(model)), config.model_dir,
        is_chief=info.is_chief,
        replica_state=replica_state.ReplicaStateFiles(
            config.model_dir, model.distribute_strategy, lambda: model.optimizer,
            max_to_keep=3),
    )


def _restore_finished_run(config, model, info, total_steps: int) -> bool:
    """Restores a finished `--loop=fit` run from `model_dir`; True if there is one.

    Raises:
        ConfigError: `model_dir` holds a final checkpoint of fewer steps than
            this run plans (fit cannot extend a finished run).
    """
    manager = _final_checkpoint(config, model, info)
    if manager.latest_checkpoint is None:
        return False
    with model.distribute_strategy.scope():  # slots exist before they are restored
        model.optimizer.build(model.trainable_variables)
    manager.restore_latest()
    done = _training_steps(model.optimizer)
    if done < total_steps:
        raise ConfigError(
            f"--model_dir={config.model_dir} holds a finished --loop=fit run of {done} "
            f"steps, and this run plans {total_steps}; --loop=fit cannot extend a finished "
            f"run. Use a new --model_dir, or --loop=custom (which continues from the "
            f"saved step)."
        )
    if info.is_chief:
        print(f"tfdp-train: {config.model_dir} already holds this run's {done} steps; "
              f"evaluating it without training.", flush=True)
    return True


def _train_with_fit(config, model, optimizer, loss, batch, dataset_for_epoch, steps_per_epoch,
                    info, clock, *, stream=None):
    """`model.fit` through `tfdp.compile`; resumable from `model_dir/backup`.

    With a `model_dir`, `tfdp.callbacks.BackupAndRestore` backs the run up
    every `--checkpoint_every` steps (else every epoch) and on SIGTERM (exit
    code 42), and a rerun of the same command resumes at the exact step; the
    final weights go to `model_dir` as a checkpoint, as `--loop=custom` does.
    """
    steps_per_execution = steps_per_execution_for(
        config.steps_per_loop, config.steps_per_epoch, config.checkpoint_every,
        _overlapped_window(config),
    )
    if steps_per_execution != config.steps_per_loop and info.is_chief:
        print(f"tfdp-train: running {steps_per_execution} steps per execution instead of "
              f"--steps_per_loop={config.steps_per_loop}, so that executions divide "
              f"--steps_per_epoch={config.steps_per_epoch}, --checkpoint_every="
              f"{config.checkpoint_every} and, with --overlap_sync, --sync_every="
              f"{config.sync_every}.")
    fit_compile.compile(
        model, optimizer=optimizer, loss=loss, metrics=["accuracy"],
        accum_steps=batch.accum_steps, steps_per_execution=steps_per_execution,
        jit_compile=config.jit_compile, all_reduce_dtype=config.all_reduce_dtype,
        loss_normalization=config.loss_normalization,
        gradient_compression=config.gradient_compression_argument(),
        sync_every=config.sync_every, outer_optimizer=config.outer_optimizer_argument(),
        overlap_sync=config.overlap_sync,
        shard_optimizer_state=config.shard_optimizer_state,
        balance_batches=config.balance_batches, bucket_cap_mb=config.bucket_cap_mb,
    )
    if getattr(model, "tfdp_balanced_batches", None) is not None:  # the plan in examples
        model.tfdp_balanced_batches.set_global_batch(batch.global_batch)
    total_steps = config.epochs * steps_per_epoch
    if config.model_dir and _restore_finished_run(config, model, info, total_steps):
        return {}, 0.0
    timer = _EpochTimer()
    callbacks = [timer]
    fit_input, fit_steps = dataset_for_epoch(0), config.steps_per_epoch
    if config.model_dir:
        backup = BackupAndRestore(os.path.join(config.model_dir, "backup"),
                                  save_freq=config.checkpoint_every or "epoch")
        fit_input, fit_steps = backup.wrap(
            dataset_for_epoch if stream is None else stream, steps_per_epoch=steps_per_epoch), None
        callbacks.append(backup)
    # On a terminal, Keras' progress bar; otherwise (under tfdp-launch) a line
    # every --log_every steps instead of one per epoch. Scalars either way.
    terminal = sys.stdout.isatty()
    callbacks.append(run_summaries.FitProgress(
        batch=batch, total_steps=total_steps, global_step=lambda: _training_steps(model.optimizer),
        log_dir=(os.path.join(config.model_dir, run_summaries.TRAIN_DIR) if config.model_dir
                 else None),
        log_every=config.log_every or steps_per_execution, is_chief=info.is_chief,
        print_fn=(lambda line: None) if terminal else (lambda line: print(line, flush=True)),
    ))
    callbacks.append(_PhaseTimer(clock))  # last: an epoch's end includes the backup's save
    verbose = 1 if info.is_chief and terminal else 0
    history = model.fit(fit_input, epochs=config.epochs, steps_per_epoch=fit_steps,
                        callbacks=callbacks, verbose=verbose)
    if config.model_dir:
        with clock.phase("outputs"):
            _final_checkpoint(config, model, info).save(_training_steps(model.optimizer))
    train_logs = {k: v[-1] for k, v in history.history.items()}
    # The last epoch's throughput: the first one includes tracing.
    seconds, steps = timer.epochs[-1] if timer.epochs else (0.0, 0)
    examples_per_second = steps * batch.global_batch / seconds if seconds else 0.0
    return train_logs, examples_per_second
