"""One training run from a `RunConfig`: `train_and_evaluate`.

This module owns the sequence of a run (validate batch against the planned
replicas, build the strategy, data, model and optimiser, train with
`model.fit` or `tfdp.Trainer`, evaluate, write `summary.json`) and the
start-up line the chief prints. It does not know where data or models come
from: the caller passes `build_dataset` and `build_model` (the `tfdp-train`
entry point wires in `pipelines` and `models`), so `tfdp` stays independent of
both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Protocol

import keras
import tensorflow as tf
from absl import logging

from tfdp import accumulation
from tfdp import checkpointing
from tfdp import lr_schedules
from tfdp import optimizers as tfdp_optimizers
from tfdp import strategy as strategy_lib
from tfdp.batch import BatchConfig
from tfdp.run_config import ConfigError
from tfdp.run_config import RunConfig
from tfdp.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What the run needs to know about a dataset to build the model and schedule.

    Attributes:
        input_shape: one example's feature shape, without the batch axis.
        num_classes: label classes.
        steps_per_epoch: optimizer steps (global batches) per epoch.
        num_examples: examples in the split.
    """

    input_shape: tuple
    num_classes: int
    steps_per_epoch: int
    num_examples: int


class BuildDataset(Protocol):
    def __call__(self, split: str, *, training: bool, strategy: tf.distribute.Strategy,
                 batch: BatchConfig, seed: int) -> tuple[Any, DatasetSpec]:
        """Returns the dataset for `split` (global batches per step) and its spec."""


BuildModel = Callable[..., keras.Model]  # (name, *, input_shape, num_classes) -> model

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


class _CheckpointEvery(keras.callbacks.Callback):
    """Saves model and optimizer every `every` optimizer steps and at the end (fit loop)."""

    def __init__(self, manager: checkpointing.ChiefCheckpointManager, every: int | None):
        super().__init__()
        self._manager, self._every, self._last = manager, every, 0

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        if self._every and step // self._every > self._last // self._every:
            self._manager.save(step)
            self._last = step

    def on_train_end(self, logs=None):
        step = self._step()
        if step != self._last:
            self._manager.save(step)


class _EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def _floats(logs: dict) -> dict:
    return {k: float(v) for k, v in logs.items()}


def train_and_evaluate(
    config: RunConfig, *, build_dataset: BuildDataset, build_model: BuildModel
) -> dict:
    """Trains `config.model` on `config.dataset` data-parallel, then evaluates.

    Every worker calls it; only the chief logs progress and writes
    `model_dir/summary.json`.

    Args:
        config: the run's options (already validated on construction).
        build_dataset: builds a split's dataset and `DatasetSpec`.
        build_model: `(name, *, input_shape, num_classes) -> keras.Model`,
            logits out.

    Returns:
        The summary: `train` and `eval` metrics, `batch`, `steps`,
        `examples_per_second`, `wall_time_seconds`, `learning_rate`,
        `strategy`, `config`.

    Raises:
        ConfigError: the batch does not divide over the replicas, or
            `--steps_per_epoch` exceeds the data, or `--loop=fit` was asked to
            continue a run in a `model_dir` that holds a checkpoint.
    """
    start = time.perf_counter()
    try:
        plan = strategy_lib.plan_from_environment(
            config.strategy, cpu_replicas=config.cpu_replicas,
            cross_device_ops=config.cross_device_ops, communication=config.communication,
            bytes_per_pack=config.bytes_per_pack,
        )
    except ValueError as error:  # contradicts the cluster or the hardware
        raise ConfigError(str(error)) from None
    batch = batch_config(config, plan.num_replicas)  # before any collective starts
    if config.loop == "fit" and config.model_dir and tf.train.latest_checkpoint(config.model_dir):
        raise ConfigError(
            f"--model_dir={config.model_dir} already holds a checkpoint, and --loop=fit "
            f"does not resume from it. Use --loop=custom (which resumes exactly) or a new "
            f"--model_dir."
        )
    if config.mixed_precision != "none":
        keras.config.set_dtype_policy(config.mixed_precision)
    strategy = strategy_lib.make_strategy(
        config.strategy, cpu_replicas=config.cpu_replicas,
        cross_device_ops=config.cross_device_ops, communication=config.communication,
        bytes_per_pack=config.bytes_per_pack,
    )
    info = strategy_lib.strategy_info(strategy)
    if config.jit_compile:
        try:
            strategy_lib.check_jit_compile_supported(strategy)
        except ValueError as error:
            raise ConfigError(f"--jit_compile: {error}") from None

    train_data, spec = build_dataset(
        "train", training=True, strategy=strategy, batch=batch, seed=epoch_seed(config.seed, 0)
    )
    steps_per_epoch = config.steps_per_epoch or spec.steps_per_epoch
    if steps_per_epoch > spec.steps_per_epoch:
        raise ConfigError(
            f"--steps_per_epoch={config.steps_per_epoch} exceeds the {spec.steps_per_epoch} "
            f"global batches of {batch.global_batch} in the {spec.num_examples} training "
            f"examples. Lower it, or leave it unset to use the whole split."
        )
    peak_lr, schedule = learning_rate_schedule(config, batch, steps_per_epoch)
    with strategy.scope():
        keras.utils.set_random_seed(config.seed)
        model = build_model(config.model, input_shape=spec.input_shape,
                            num_classes=spec.num_classes)
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

    train_started = time.perf_counter()
    if config.loop == "fit":
        train_logs, examples_per_second = _train_with_fit(
            config, model, optimizer, loss, batch, train_data, steps_per_epoch, info
        )
        eval_model = model
        steps = int(optimizer.iterations.numpy())
    else:
        trainer = Trainer(
            model, optimizer=optimizer, loss=loss, strategy=strategy, batch=batch,
            metrics=["accuracy"], model_dir=config.model_dir,
            steps_per_loop=config.steps_per_loop, checkpoint_every=config.checkpoint_every,
            jit_compile=config.jit_compile,
        )

        def dataset_for_epoch(epoch: int):
            if epoch == 0:
                return train_data
            return build_dataset("train", training=True, strategy=strategy, batch=batch,
                                 seed=epoch_seed(config.seed, epoch))[0]

        result = trainer.train(dataset_for_epoch, epochs=config.epochs,
                               steps_per_epoch=steps_per_epoch)
        examples_per_second = result.pop("examples_per_second")
        steps = int(result.pop("steps"))
        result.pop("epochs")
        train_logs = result
        eval_model = trainer
    train_seconds = time.perf_counter() - train_started

    eval_logs: dict = {}
    if config.eval:
        eval_data, _ = build_dataset("test", training=False, strategy=strategy, batch=batch,
                                     seed=config.seed)
        if config.loop == "fit":
            eval_logs = _floats(eval_model.evaluate(eval_data, return_dict=True, verbose=0))
        else:
            eval_logs = _floats(eval_model.evaluate(eval_data))
    summary = {
        "train": _floats(train_logs),
        "eval": eval_logs,
        "batch": {
            "per_replica": batch.per_replica, "replicas": batch.num_replicas,
            "accum_steps": batch.accum_steps, "global": batch.global_batch,
        },
        "steps": steps,
        "steps_per_epoch": steps_per_epoch,
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
            with open(os.path.join(config.model_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2, default=str)
    return summary


def steps_per_execution_for(steps_per_loop: int, steps_per_epoch: int | None) -> int:
    """The largest divisor of `steps_per_epoch` that is <= `steps_per_loop`.

    Keras' epoch iterator runs whole executions: with an explicit
    `steps_per_epoch` that `steps_per_execution` does not divide, the last
    execution of every epoch overruns it (5 steps per epoch at 2 per
    execution run 6). A divisor keeps one epoch = `steps_per_epoch` steps.
    """
    if not steps_per_epoch:
        return steps_per_loop
    return max(d for d in range(1, min(steps_per_loop, steps_per_epoch) + 1)
               if steps_per_epoch % d == 0)


def _train_with_fit(config, model, optimizer, loss, batch, train_data, steps_per_epoch, info):
    steps_per_execution = steps_per_execution_for(config.steps_per_loop, config.steps_per_epoch)
    if steps_per_execution != config.steps_per_loop and info.is_chief:
        print(f"tfdp-train: --steps_per_loop={config.steps_per_loop} does not divide "
              f"--steps_per_epoch={config.steps_per_epoch}; running {steps_per_execution} "
              f"steps per execution so that every epoch has exactly "
              f"{config.steps_per_epoch} steps.")
    accumulation.compile(
        model, optimizer=optimizer, loss=loss, metrics=["accuracy"],
        accum_steps=config.accum_steps, steps_per_execution=steps_per_execution,
        jit_compile=config.jit_compile,
    )
    timer = _EpochTimer()
    callbacks = [timer]
    if config.model_dir:
        manager = checkpointing.ChiefCheckpointManager(
            tf.train.Checkpoint(model=model, optimizer=optimizer), config.model_dir,
            is_chief=info.is_chief,
        )
        callbacks.append(_CheckpointEvery(manager, config.checkpoint_every))
    verbose = (1 if sys.stdout.isatty() else 2) if info.is_chief else 0
    history = model.fit(
        train_data, epochs=config.epochs, steps_per_epoch=config.steps_per_epoch,
        callbacks=callbacks, verbose=verbose,
    )
    train_logs = {k: v[-1] for k, v in history.history.items()}
    # The last epoch's throughput: the first one includes tracing.
    examples_per_second = steps_per_epoch * batch.global_batch / timer.seconds[-1]
    return train_logs, examples_per_second
