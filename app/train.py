"""`tfdp-train`: train a registered model on a registered dataset, data-parallel.

    tfdp-train --dataset=digits --model=cnn --global_batch=64 --model_dir=runs/digits
    tfdp-launch --nproc_per_node 2 -- tfdp-train --dataset=digits --model=cnn \\
        --global_batch=64 --model_dir=runs/digits

This is the entry point that wires `tfdp.pipelines` (data) and `tfdp.models`
into `tfdp.app.experiment.train_and_evaluate`, which takes them as arguments
(the library below never imports them; `tests/test_layout.py`). It reads and
validates flags into one `RunConfig`, checks the model against the dataset and
its splits (`tfdp.app.compatibility`: kind, rank, dtype, image size, classes,
token padding), then calls it: invalid or contradictory flags and misfits exit
with status 2 and one line naming the flags and the fix, before any training
or collective.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

# Where the imports phase starts if the process's own start time is unknown (not Linux).
_MODULE_STARTED = time.perf_counter()

# TensorFlow's C++ start-up chatter (INFO) before it is imported; warnings stay.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tfdp.distribute import reduction  # noqa: E402
from tfdp.app import compatibility  # noqa: E402
from tfdp.app import data_description  # noqa: E402
from tfdp.app import run_config  # noqa: E402
from tfdp.app import user_data  # noqa: E402
from tfdp.app.process_logging import configure_logging  # noqa: E402
from tfdp.app.process_logging import process_is_chief  # noqa: E402
from tfdp.app.phase_clock import PhaseClock  # noqa: E402
from tfdp.app.phase_clock import process_start  # noqa: E402
from tfdp._upstream import interpreter_exit  # noqa: E402
from tfdp.distribute import config_check  # noqa: E402
from tfdp.distribute import peer_failures  # noqa: E402
from tfdp.distribute import startup  # noqa: E402
from tfdp.distribute import strategy as strategy_lib  # noqa: E402
from tfdp.training import lr_schedules  # noqa: E402

_D = run_config.RunConfig()  # defaults, one source of truth

# What to train.
flags.DEFINE_string("model", _D.model, "Registered model name (see models.names()).")
flags.DEFINE_bool("remat", _D.remat, "Recompute each block's activations in the backward pass "
                  "instead of keeping them: less activation memory for about one more forward "
                  "pass per step, same gradients (transformer, resnet20/32/56, resnet50).")
flags.DEFINE_bool("sync_bn", _D.sync_bn, "Batch normalisation statistics over the global batch "
                  "(all replicas and workers; with --accum_steps, over each global "
                  "micro-batch) instead of each replica's share; 3 small all-reduces per "
                  "BatchNormalization layer per micro-batch (resnet20/32/56, resnet50).")
flags.DEFINE_string("dataset", _D.dataset, "Registered dataset: digits (offline), a TFDS "
                    "name such as mnist or cifar10, or synthetic sources; tfrecord (your files, "
                    "--train_files); or python:package.module:function (your tf.data code).")
flags.DEFINE_string("data_dir", None, "TFDS data directory (default: $TFDP_DATA_DIR or "
                    "~/tensorflow_datasets).")
flags.DEFINE_integer("epochs", _D.epochs, "Epochs to train.")
flags.DEFINE_integer("steps_per_epoch", None, "Optimizer steps per epoch (default: the whole "
                     "training split).")
flags.DEFINE_bool("eval", _D.eval, "Evaluate at the end, on --eval_split.")
flags.DEFINE_string("eval_split", None, "The split --eval reads (default: test, else "
                    "validation; a dataset with neither is refused, listing its splits).")
flags.DEFINE_integer("image_size", None, "Resize images to this square size in pixels, in the "
                     "input pipeline (e.g. 32 for --model=resnet50 on the 8x8 digits); with "
                     "--dataset=tfrecord, as they are decoded (default: the first record's "
                     "size, which every image must have).")
flags.DEFINE_integer("sequence_length", None, "Pad (with id 0) or truncate token sequences to "
                     "this many tokens (default: the dataset's longest, e.g. 64 for "
                     "synthetic_tokens).")
flags.DEFINE_integer("seed", _D.seed, "Seed for initialisation and shuffling.")
# Your own data: --dataset=tfrecord.
flags.DEFINE_string("train_files", None, "With --dataset=tfrecord: glob(s), comma-separated, of "
                    "TFRecord files of tf.train.Example records (local or any filesystem "
                    "TensorFlow reads), sharded across workers by file.")
flags.DEFINE_string("eval_files", None, "With --dataset=tfrecord: the files --eval evaluates on.")
flags.DEFINE_string("image_key", _D.image_key, "With --dataset=tfrecord: the feature holding "
                    "the JPEG or PNG bytes.")
flags.DEFINE_string("label_key", _D.label_key, "With --dataset=tfrecord: the int64 class feature.")
flags.DEFINE_integer("image_channels", _D.image_channels, "With --dataset=tfrecord: decode "
                     "images to this many channels (1, 3 or 4).")
flags.DEFINE_integer("num_classes", None, "With --dataset=tfrecord or python:...: label classes "
                     "(default: what the source says; for tfrecord the largest label + 1, read "
                     "in the counting pass).")
flags.DEFINE_integer("train_examples", None, "With --dataset=tfrecord: examples in --train_files "
                     "(default: counted once and cached in --model_dir, or beside the files).")
# Where.
flags.DEFINE_enum("strategy", _D.strategy, strategy_lib.KINDS, "Distribution strategy.")
flags.DEFINE_integer("cpu_replicas", None, "Split the CPU into this many replicas (one "
                     "process, no GPU).")
flags.DEFINE_enum("cross_device_ops", _D.cross_device_ops, strategy_lib.CROSS_DEVICE_OPS,
                  "MirroredStrategy all-reduce.")
flags.DEFINE_enum("communication", _D.communication, strategy_lib.COMMUNICATIONS,
                  "MultiWorkerMirroredStrategy collectives.")
flags.DEFINE_integer("bytes_per_pack", _D.bytes_per_pack, "MultiWorkerMirroredStrategy "
                     "gradient pack size in bytes (0: one pack, TensorFlow's default; "
                     "unset: 4 MiB on CPU workers, 0 on GPU workers).")
flags.DEFINE_float("collective_timeout", None, "MultiWorkerMirroredStrategy: fail a collective "
                   "that waits longer than this many seconds for a stuck or stopped worker "
                   "(default: wait forever).")
flags.DEFINE_bool("gpu_memory_growth", _D.gpu_memory_growth, "Allocate GPU memory as needed "
                  "instead of almost all of every visible GPU at start (TensorFlow's memory "
                  "growth; off by default, as in TensorFlow).")
# Batch.
flags.DEFINE_integer("global_batch", None, "Examples per optimizer step over all replicas "
                     "(at most one of --global_batch, --per_replica_batch; neither: "
                     f"{run_config.DEFAULT_GLOBAL_BATCH} global).")
flags.DEFINE_integer("per_replica_batch", None, "Examples per replica per micro-batch.")
flags.DEFINE_integer("accum_steps", _D.accum_steps, "Micro-batches accumulated per "
                     "optimizer step.")
# Optimiser.
flags.DEFINE_enum("optimizer", _D.optimizer, run_config.OPTIMIZERS, "Optimizer "
                  "(momentum: SGD with momentum 0.9).")
flags.DEFINE_float("base_lr", _D.base_lr, "Learning rate at --base_batch.")
flags.DEFINE_integer("base_batch", None, "Batch --base_lr was tuned for (default: the "
                     "global batch, no scaling).")
flags.DEFINE_enum("lr_scaling", _D.lr_scaling, lr_schedules.SCALING_RULES,
                  "How the learning rate scales from --base_batch to the global batch.")
flags.DEFINE_float("warmup_epochs", None, "Linear warmup, in epochs.")
flags.DEFINE_integer("warmup_steps", None, "Linear warmup, in optimizer steps.")
flags.DEFINE_enum("decay", _D.decay, lr_schedules.DECAYS, "Learning-rate decay after warmup.")
flags.DEFINE_float("weight_decay", _D.weight_decay, "Weight decay.")
# How.
flags.DEFINE_enum("loop", _D.loop, run_config.LOOPS, "fit: Keras model.fit via tfdp.compile; "
                  "custom: tfdp.Trainer (resumes exactly from --model_dir).")
flags.DEFINE_integer("steps_per_loop", _D.steps_per_loop, "Optimizer steps per tf.function "
                     "call.")
flags.DEFINE_enum("mixed_precision", _D.mixed_precision, run_config.MIXED_PRECISIONS,
                  "Keras dtype policy.")
flags.DEFINE_bool("jit_compile", _D.jit_compile, "Compile the train step with XLA.")
flags.DEFINE_enum("all_reduce_dtype", _D.all_reduce_dtype, reduction.ALL_REDUCE_DTYPES,
                  "Sum gradients over replicas in this dtype (half the bytes for bfloat16, "
                  "about 3 significant digits per sum); unset: in their own dtype.")
flags.DEFINE_enum("gradient_compression", _D.gradient_compression,
                  run_config.GRADIENT_COMPRESSIONS,
                  "How gradients cross the wire: none (all-reduced as they are), bfloat16 (half "
                  "the bytes), powersgd (rank --compression_rank, two small all-reduces), topk "
                  "(the --topk_fraction largest values, one all-gather), float8 (8-bit E4M3 "
                  "values with a per-tensor scale, one all-gather: a quarter of the bytes); the "
                  "last three with error feedback.")
flags.DEFINE_integer("compression_rank", _D.compression_rank,
                     "PowerSGD's rank (with --gradient_compression=powersgd).")
flags.DEFINE_float("topk_fraction", _D.topk_fraction, "Share of gradient values each replica "
                   "sends per step (with --gradient_compression=topk).")
flags.DEFINE_integer("sync_every", _D.sync_every, "Local SGD: each replica steps on its own "
                     "gradients (no gradient all-reduce) and the weights are averaged every N "
                     "optimizer steps and at each epoch's end; 1: synchronous training.")
flags.DEFINE_float("outer_lr", None, "DiLoCo: at each synchronisation an outer Nesterov SGD step "
                   "with this learning rate (0.7 in the paper) from the last synchronised weights "
                   "along their difference with the average; unset: plain averaging.")
flags.DEFINE_float("outer_momentum", None, "DiLoCo's outer Nesterov momentum (with --outer_lr; "
                   "default 0.9, as in the paper).")
flags.DEFINE_bool("overlap_sync", _D.overlap_sync, "With --sync_every > 1 or --outer_lr: each "
                  "window's weight all-reduce runs in the background during the next window and "
                  "is applied one window late (tfdp.compile(overlap_sync=True)).")
flags.DEFINE_float("bucket_cap_mb", None, "PyTorch DDP's gradient buckets: the gradients are "
                   "all-reduced in buckets of at most this many MiB (the first at most 1 MiB), "
                   "last layers first, each as soon as its gradients exist, during the rest of "
                   "the backward pass (tfdp.compile(bucket_cap_mb=...)); unset: one all-reduce "
                   "after the backward pass.")
flags.DEFINE_bool("shard_optimizer_state", _D.shard_optimizer_state, "ZeRO-1: each replica "
                  "keeps the optimizer's slots (momentum, Adam's moments) for its 1/N share of "
                  "the weights only, and the updated shares are all-gathered every step.")
flags.DEFINE_enum("loss_normalization", _D.loss_normalization, run_config.LOSS_NORMALIZATIONS,
                  "global: the loss of the global batch as one device computes it (masks, "
                  "weights, every reduction); per_replica: each replica's mean, averaged, as "
                  "stock Keras.")
flags.DEFINE_string("model_dir", None, "Checkpoints, TensorBoard summaries (train/, eval/), "
                    "curves.png and summary.json.")
flags.DEFINE_integer("checkpoint_every", None, "Checkpoint every N optimizer steps (and at "
                     "the end).")
flags.DEFINE_integer("log_every", None, "--loop=fit: a progress line (when stdout is not a "
                     "terminal) and TensorBoard scalars every N optimizer steps (default: every "
                     "--steps_per_loop).")

flags.DEFINE_bool("balance_batches", False, "Each worker computes a share of every global "
                  "batch that follows its measured speed (re-planned every 20 steps), so a "
                  "slow worker no longer holds the others back; the global batch, loss and "
                  "gradient stay the same. Every worker reads each global batch whole, in one "
                  "seekable order (exactly once per epoch, resumable at any step). Not with "
                  "--accum_steps>1, local steps, gradient compression, "
                  "--shard_optimizer_state, --jit_compile or "
                  "--loss_normalization=per_replica.")

FLAGS = flags.FLAGS


def config_from_flags() -> run_config.RunConfig:
    """Maps the parsed flags onto a `RunConfig` (which validates them)."""
    fields = {field: getattr(FLAGS, field) for field in run_config.RunConfig.__dataclass_fields__}
    return run_config.RunConfig(**fields)


def dataset_source(config: run_config.RunConfig):
    """What `pipelines` reads for `--dataset`: a registered name, the user's
    TFRecord files, or what the user's `python:` function gives."""
    from tfdp.pipelines import source as source_lib

    if config.dataset.startswith(user_data.PYTHON_PREFIX):
        try:
            source = user_data.python_source(config.dataset)
        except user_data.UserDataError as error:
            raise run_config.ConfigError(str(error)) from None
        if config.eval and isinstance(source, (source_lib.DatasetSource,
                                               source_lib.CallableSource)):
            raise run_config.ConfigError(
                f"--dataset={config.dataset} gives one split (a dataset, or a function of the "
                f"input context), so --eval has nothing to evaluate on. Pass --noeval, or "
                f"return a pipelines.Source with a 'test' split.")
        return source
    if config.dataset != user_data.TFRECORD:
        return config.dataset
    return user_data.train_options(config, count_cache_dir=config.model_dir).source()


def _eval_split(config: run_config.RunConfig, source, data) -> str:
    """The split --eval reads, checked against the built source (exit 2 if it has none)."""
    if data.splits is not None or config.dataset == user_data.TFRECORD:
        return compatibility.eval_split(config.eval_split, data)
    # A source that does not list its splits (your python: Source): ask it.
    candidates = ([config.eval_split] if config.eval_split is not None
                  else list(compatibility.DEFAULT_EVAL_SPLITS))
    errors = []
    for split in candidates:
        try:
            source.check_split(split)
            return split
        except ValueError as error:
            errors.append(str(error))
    raise compatibility.IncompatibleError(
        f"--dataset={config.dataset} has no split {' or '.join(map(repr, candidates))} to "
        f"evaluate on ({errors[-1]}). Pass --eval_split=NAME, or --noeval.")


def _build_dataset(config: run_config.RunConfig, before=None):
    """`build_dataset` for `experiment.train_and_evaluate`.

    The source is made on first use, once the strategy exists, then kept (its
    counts are read once); it is then described exactly and checked against
    the model again (`tfdp.app.compatibility`): your `python:` data and the
    size of your TFRecord images are known only now. A misfit still exits 2
    before the model is built or a step runs.

    Args:
        config: the run's options.
        before: what `data_description.describe_before_strategy` said.
    """
    from tfdp import pipelines

    from tfdp.app import experiment

    made = {}

    def prepare():
        if made:
            return made
        source = dataset_source(config)
        if isinstance(source, str):  # a registered or TFDS name: its Source says more
            source = pipelines.get_source(source, data_dir=config.data_dir)
        info = pipelines.describe_source(source, split="train", data_dir=config.data_dir)
        data = data_description.describe_source(config.dataset, source, info.features,
                                                info.num_classes, before=before)
        made["plan"] = compatibility.check(
            config.model, data, image_size=config.image_size,
            sequence_length=config.sequence_length, num_classes=config.num_classes)
        made["eval_split"] = _eval_split(config, source, data) if config.eval else None
        made["source"] = source
        # No strategy: what --balance_batches reads the training split under.
        # Taken now, outside any strategy's scope (later epochs may be built
        # inside fit's).
        import tensorflow as tf

        made["no_strategy"] = tf.distribute.get_strategy()
        return made

    def build(role, *, training, strategy, batch, seed):
        state = prepare()
        split = state["eval_split"] if role == experiment.EVAL else role
        source, plan = state["source"], state["plan"]
        # Dataset-specific preprocessing: uint8 images scaled to [0, 1], then
        # resized (--image_size); token ids padded (--sequence_length).
        source_info = pipelines.describe_source(source, split=split, data_dir=config.data_dir)
        whole = training and config.balance_batches and strategy.num_replicas_in_sync > 1
        dataset = pipelines.make_dataset(
            source, split=split, training=training, seed=seed, data_dir=config.data_dir,
            preprocess=plan.preprocess(source_info.features, training=training),
            **(whole_global_batches(batch, state["no_strategy"]) if whole
               else {"strategy": strategy, "batch": batch}),
            # The run iterates a training stream, not epoch 0's dataset, where
            # it can: planned only, epoch 0 is built if it is asked for. The
            # balanced path's whole global batches are a plain tf.data.Dataset.
            distribute=not training or whole,
        )
        info = dataset.pipeline_info
        feature_spec = info.element_spec[0]
        num_classes = config.num_classes or info.num_classes
        if num_classes is None:
            raise run_config.ConfigError(
                f"--dataset={config.dataset} does not say how many classes its labels have; "
                f"pass --num_classes.")
        return dataset, experiment.DatasetSpec(
            input_shape=tuple(feature_spec.shape), num_classes=num_classes,
            steps_per_epoch=info.steps_per_epoch, num_examples=info.num_examples,
            split=split, model_arguments=dict(plan.model_arguments),
        )

    return build


def whole_global_batches(batch, no_strategy) -> dict:
    """`make_dataset` arguments for --balance_batches: one pipeline of whole global batches.

    Balanced batches cut each worker's share inside the step, so every worker
    reads every global batch whole, in the same order. The training split is
    therefore read as one input pipeline feeding one replica a batch of
    `batch.global_batch`, with no strategy, on every worker alike: the same
    seekable epoch order (`epoch_stream`, `start_at_batch`), so each example
    is computed once per epoch and a resumed run enters its epoch at the
    exact batch.

    Args:
        batch: the run's `BatchConfig`.
        no_strategy: TensorFlow's default strategy
            (`tf.distribute.get_strategy()` outside any scope).
    """
    from tfdp.training.batch import BatchConfig

    return {"strategy": no_strategy, "batch": BatchConfig.from_global(batch.global_batch, 1)}


def _build_model(config: run_config.RunConfig):
    """`build_model` for `experiment.train_and_evaluate`: `models.get` with the
    flags' options; a builder's refusal exits 2 (a model you registered
    without declared inputs is checked only here)."""
    from tfdp import models

    def build(name, **kwargs):
        try:
            return models.get(name, **config.model_arguments(), **kwargs)
        except ValueError as error:
            raise run_config.ConfigError(
                f"--model={name} cannot be built for --dataset={config.dataset}: {error}"
            ) from None

    return build


def _check_inputs(config: run_config.RunConfig, *, require_prepared: bool = True):
    """Checks --model against --dataset and its splits from metadata alone.

    Starts no TensorFlow runtime (see `_check_names`).

    Args:
        config: the run's options.
        require_prepared: refuse a TFDS dataset that is not prepared. Defaults
            to True (False checks a command for another machine, e.g. the
            README's).

    Returns:
        The dataset's `DataDescription`, or None when it is known only once
        built (your `python:` code).

    Raises:
        ConfigError: the dataset cannot be read (a TFDS dataset not
            prepared), or does not fit the model, or lacks a split.
    """
    data = data_description.describe_before_strategy(config)
    if data is not None and data.unavailable and require_prepared:
        raise run_config.ConfigError(f"--dataset={config.dataset}: {data.unavailable}.")
    compatibility.check(config.model, data, image_size=config.image_size,
                        sequence_length=config.sequence_length, num_classes=config.num_classes)
    compatibility.check_split("train", data, flag="--dataset")
    if config.eval:
        compatibility.eval_split(config.eval_split, data)
    return data


def _check_names(config: run_config.RunConfig) -> None:
    """Checks --model and --dataset without starting TensorFlow's runtime.

    The strategy must be built first (`MultiWorkerMirroredStrategy` configures
    collective ops at start-up), so nothing here may create a tensor or read
    data: the digits dataset is prepared later, by the first dataset built.
    """
    from tfdp import models
    from tfdp import pipelines

    if config.model not in models.names():
        raise run_config.ConfigError(
            f"--model must be one of {', '.join(models.names())}. "
            f"Received: --model={config.model!r}"
        )
    for flag, needs in (("remat", "blocks to recompute"), ("sync_bn", "BatchNormalization")):
        if getattr(config, flag) and not models.accepts(config.model, flag):
            supported = [name for name in models.names() if models.accepts(name, flag)]
            raise run_config.ConfigError(
                f"--{flag}: model {config.model!r} has no {needs}. Models that take --{flag}: "
                f"{', '.join(supported)}. Received: --model={config.model} --{flag}")
    if config.dataset.startswith(user_data.PYTHON_PREFIX):
        try:  # imported now; called once the strategy exists
            user_data.python_function(config.dataset)
        except user_data.UserDataError as error:
            raise run_config.ConfigError(str(error)) from None
        return
    if config.dataset == user_data.TFRECORD:
        source = user_data.train_options(config, count_cache_dir=None).source()
        for split, flag in (("train", "--train_files"), ("test", "--eval_files")):
            if split == "train" or config.eval:
                try:  # globs only: no record is read, no tensor made
                    source.check_split(split)
                except ValueError as error:
                    raise run_config.ConfigError(f"{flag}: {error}") from None
        return
    try:
        pipelines.check_source_name(config.dataset)
    except ValueError as error:
        raise run_config.ConfigError(f"--dataset: {error}") from None


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    from tfdp.app import experiment

    # Wall time by phase, from the process's start: everything so far is imports.
    started = process_start()
    clock = PhaseClock(origin=_MODULE_STARTED if started is None else started)
    clock.record("imports", clock.elapsed())
    try:
        with clock.phase("checks"):
            config = config_from_flags()
            _check_names(config)
            described = _check_inputs(config)
            configure_logging(process_is_chief())
        with peer_failures.explain_peer_failures(collective_timeout=config.collective_timeout):
            experiment.train_and_evaluate(
                config, build_dataset=_build_dataset(config, described),
                build_model=_build_model(config), clock=clock,
            )
    except (run_config.ConfigError, config_check.ConfigMismatchError) as error:
        print(f"tfdp-train: error: {error}", file=sys.stderr)
        sys.exit(2)
    except startup.StartupError as error:
        # 44 when this worker's own port was taken (the launcher retries it), else 1.
        print(f"tfdp-train: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except peer_failures.PeerFailureError as error:
        # 43 for a lost peer (schedulers retry it), 1 for a stuck one.
        print(f"tfdp-train: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)


def _main_then_exit(argv: Sequence[str]) -> None:
    main(argv)  # errors raise (or sys.exit) here: the normal exit, traceback and code
    interpreter_exit.exit_without_teardown(0)


def run() -> None:
    """Console-script entry point (`tfdp-train`)."""
    app.run(_main_then_exit)


if __name__ == "__main__":
    run()
