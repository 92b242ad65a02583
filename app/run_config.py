"""The options of one training run, validated before anything starts.

`RunConfig` is what `tfdp-train`'s flags map to, one field per flag, and what
`tfdp.app.experiment.train_and_evaluate` takes. This module owns the rules that
need no TensorFlow state (choices, ranges, flags that contradict each other);
it does not read flags (`tfdp.app.train` does) or build anything.
"""

from __future__ import annotations

import dataclasses

from tfdp.app import user_data
from tfdp.distribute import reduction
from tfdp.distribute import strategy as strategy_lib
from tfdp.training import lr_schedules

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "lars", "lamb")
LOOPS = ("fit", "custom")
MIXED_PRECISIONS = ("none", "mixed_float16", "mixed_bfloat16")
#: `tfdp.training.loss_normalization.MODES`, repeated so that parsing flags
#: does not import Keras (tests/app checks they agree).
LOSS_NORMALIZATIONS = ("global", "per_replica")
#: --gradient_compression: how gradients cross the wire (`tfdp.compression`).
GRADIENT_COMPRESSIONS = ("none", "bfloat16", "powersgd", "topk", "float8")
#: The global batch when neither --global_batch nor --per_replica_batch is given.
DEFAULT_GLOBAL_BATCH = 64


class ConfigError(ValueError):
    """An option (flag) is invalid or contradicts another; raised before training."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one `tfdp-train` run needs; each field is the flag of that name.

    What to train:
        model: registered model name (`models.get`). remat: recompute each
        block's activations in the backward pass (models with blocks: the
        transformer and the ResNets). sync_bn: batch normalisation statistics
        over the global batch, or over each global micro-batch with
        accum_steps > 1 (models with BatchNormalization: the ResNets).
        dataset: registered source name (`pipelines`). data_dir: TFDS data directory (None: default).
        epochs: epochs to train. steps_per_epoch: optimizer steps per epoch
        (None: the whole training split). eval: evaluate on eval_split
        at the end. seed: seeds initialisation and shuffling.
        eval_split: the split --eval reads (None: "test", else "validation";
        `tfdp.app.compatibility.eval_split`). image_size: resize images to
        this square size in pixels (None: as they are). sequence_length:
        pad or truncate token sequences to this many tokens (None: the
        dataset's longest).
        With dataset "tfrecord" (`tfdp.app.user_data`): train_files and
        eval_files (globs of tf.train.Example files), image_key, label_key,
        image_channels, num_classes, train_examples.

    Where: strategy, cpu_replicas, cross_device_ops, communication,
        bytes_per_pack: see `tfdp.make_strategy`; collective_timeout: its
        `timeout_seconds` (None: wait forever); gpu_memory_growth: its
        `memory_growth` (GPU memory taken as needed, not all at start).

    Batch (examples per optimizer step; see `tfdp.BatchConfig`): at most one
        of global_batch and per_replica_batch (neither: global_batch =
        DEFAULT_GLOBAL_BATCH), and accum_steps.

    Optimiser: optimizer; base_lr, the learning rate tuned at base_batch
        (None: the global batch, i.e. no scaling); lr_scaling (`tfdp.scale_lr`
        rule); warmup_epochs or warmup_steps; decay (`tfdp.WarmupSchedule`);
        weight_decay.

    How: loop (`fit`: Keras `model.fit` through `tfdp.compile`; `custom`:
        `tfdp.Trainer`), steps_per_loop (optimizer steps per `tf.function`
        call: `steps_per_execution` for fit), mixed_precision, jit_compile,
        all_reduce_dtype (None or "bfloat16": the dtype gradients are summed
        over replicas in; `tfdp.distribute.reduction`), loss_normalization
        ("global": the loss of the global batch as one device computes it;
        "per_replica": each replica's mean, averaged, as stock Keras;
        `tfdp.training.loss_normalization`),
        gradient_compression ("none", "bfloat16", "powersgd" with
        compression_rank, "topk" with topk_fraction, "float8";
        `tfdp.compression`),
        sync_every (local SGD: optimizer steps between averages of the
        weights; 1: synchronous), outer_lr and outer_momentum (DiLoCo's
        Nesterov outer step at each synchronisation; `tfdp.distribute.local_sync`),
        overlap_sync (that synchronisation's all-reduce runs during the next
        window, applied one window late; `tfdp.distribute.overlapped_sync`),
        shard_optimizer_state (ZeRO-1: each replica keeps the optimizer's
        slots for its 1/N of the weights; `tfdp.distribute.optimizer_sharding`),
        balance_batches (each worker reads every global batch whole and
        computes a share that follows its measured speed;
        `tfdp.training.balanced_batches`),
        bucket_cap_mb (None: one gradient all-reduce after the backward
        pass; MiB: DDP's gradient buckets, each all-reduced during the
        backward pass; `tfdp.training.exchanges.bucketed`),
        model_dir (checkpoints, TensorBoard, summary.json; None: none),
        checkpoint_every (optimizer steps; None: at the end only),
        log_every (--loop=fit: optimizer steps between the chief's progress
        lines and TensorBoard scalars; None: every steps_per_loop).
    """

    model: str = "cnn"
    remat: bool = False
    sync_bn: bool = False
    dataset: str = "digits"
    data_dir: str | None = None
    epochs: int = 10
    steps_per_epoch: int | None = None
    eval: bool = True
    seed: int = 0
    train_files: str | None = None
    eval_files: str | None = None
    image_key: str = "image/encoded"
    label_key: str = "image/class/label"
    image_size: int | None = None
    image_channels: int = 3
    num_classes: int | None = None
    train_examples: int | None = None
    sequence_length: int | None = None
    eval_split: str | None = None

    strategy: str = "auto"
    cpu_replicas: int | None = None
    cross_device_ops: str = "auto"
    communication: str = "auto"
    bytes_per_pack: int | None = None
    collective_timeout: float | None = None
    gpu_memory_growth: bool = False

    global_batch: int | None = None
    per_replica_batch: int | None = None
    accum_steps: int = 1

    optimizer: str = "momentum"
    base_lr: float = 0.05
    base_batch: int | None = None
    lr_scaling: str = "linear"
    warmup_epochs: float | None = None
    warmup_steps: int | None = None
    decay: str = "cosine"
    weight_decay: float = 0.0

    loop: str = "fit"
    steps_per_loop: int = 10
    mixed_precision: str = "none"
    jit_compile: bool = False
    all_reduce_dtype: str | None = None
    loss_normalization: str = "global"
    gradient_compression: str = "none"
    compression_rank: int = 4
    topk_fraction: float = 0.01
    sync_every: int = 1
    outer_lr: float | None = None
    outer_momentum: float | None = None
    overlap_sync: bool = False
    shard_optimizer_state: bool = False
    balance_batches: bool = False
    bucket_cap_mb: float | None = None
    model_dir: str | None = None
    checkpoint_every: int | None = None
    log_every: int | None = None

    def __post_init__(self):
        if self.global_batch is None and self.per_replica_batch is None:
            object.__setattr__(self, "global_batch", DEFAULT_GLOBAL_BATCH)
        self.validate()

    def validate(self) -> None:
        """Checks every rule that needs no TensorFlow state.

        Raises:
            ConfigError: naming the flag, the rule, what was received and the fix.
        """
        _choice("strategy", self.strategy, strategy_lib.KINDS)
        _choice("cross_device_ops", self.cross_device_ops, strategy_lib.CROSS_DEVICE_OPS)
        _choice("communication", self.communication, strategy_lib.COMMUNICATIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_scaling", self.lr_scaling, lr_schedules.SCALING_RULES)
        _choice("decay", self.decay, lr_schedules.DECAYS)
        _choice("loop", self.loop, LOOPS)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _choice("loss_normalization", self.loss_normalization, LOSS_NORMALIZATIONS)
        if self.all_reduce_dtype is not None:
            _choice("all_reduce_dtype", self.all_reduce_dtype, reduction.ALL_REDUCE_DTYPES)
        _choice("gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
        _positive("compression_rank", self.compression_rank)
        if (isinstance(self.topk_fraction, bool) or not isinstance(self.topk_fraction, (int, float))
                or not 0 < self.topk_fraction <= 1):
            raise ConfigError("--topk_fraction must be in (0, 1] (the share of gradient values "
                              f"each replica sends). Received: --topk_fraction={self.topk_fraction!r}")
        self._validate_local_steps()
        if self.bucket_cap_mb is not None and not 0 < self.bucket_cap_mb < float("inf"):
            raise ConfigError("--bucket_cap_mb must be a positive number of MiB per gradient "
                              "bucket (PyTorch DDP's default is 25), or unset for one all-reduce "
                              f"after the backward pass. Received: --bucket_cap_mb={self.bucket_cap_mb!r}")
        _positive("train_examples", self.train_examples, allow_none=True)
        _positive("image_size", self.image_size, allow_none=True, hint=" (pixels)")
        _positive("sequence_length", self.sequence_length, allow_none=True, hint=" (tokens)")
        if self.eval_split is not None:
            if not isinstance(self.eval_split, str) or not self.eval_split.strip():
                raise ConfigError("--eval_split must name a split of --dataset, e.g. test or "
                                  f"validation. Received: --eval_split={self.eval_split!r}")
            if not self.eval:
                raise ConfigError(f"--eval_split={self.eval_split} has nothing to pick with "
                                  f"--noeval. Drop one of them.")
        try:
            user_data.check_train_flags(
                self.dataset, {name: getattr(self, name) for name in user_data.TRAIN_FLAGS},
                evaluate=self.eval)
            if self.dataset == user_data.TFRECORD:
                user_data.train_options(self, count_cache_dir=None)  # checks the values
        except user_data.UserDataError as error:
            raise ConfigError(str(error)) from None
        if self.gradient_compression == "float8" and self.all_reduce_dtype is not None:
            raise ConfigError(
                f"--gradient_compression=float8 cannot be combined with --all_reduce_dtype="
                f"{self.all_reduce_dtype}: float8 always sends its own 8-bit values, so the dtype "
                "would be ignored. Use --gradient_compression=float8 alone, or "
                "--gradient_compression=bfloat16. Received: --gradient_compression=float8, "
                f"--all_reduce_dtype={self.all_reduce_dtype}")
        if self.gradient_compression == "bfloat16" and self.all_reduce_dtype not in (None, "bfloat16"):
            raise ConfigError("--gradient_compression=bfloat16 and --all_reduce_dtype="
                              f"{self.all_reduce_dtype} disagree; pass only --gradient_compression.")
        for name in ("model", "dataset"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"--{name} must name a registered {name}. "
                                 f"Received: --{name}={getattr(self, name)!r}")
        _positive("epochs", self.epochs)
        _positive("steps_per_epoch", self.steps_per_epoch, allow_none=True)
        _positive("cpu_replicas", self.cpu_replicas, allow_none=True)
        _positive("bytes_per_pack", self.bytes_per_pack, minimum=0, allow_none=True)
        _positive("accum_steps", self.accum_steps, hint=" (1: no accumulation)")
        self._validate_balance_batches()
        for name in ("remat", "sync_bn"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"--{name} must be true or false. "
                                  f"Received: --{name}={getattr(self, name)!r}")
        _positive("steps_per_loop", self.steps_per_loop)
        _positive("checkpoint_every", self.checkpoint_every, allow_none=True)
        _positive("log_every", self.log_every, allow_none=True)
        _positive("base_batch", self.base_batch, allow_none=True)
        _positive("warmup_steps", self.warmup_steps, allow_none=True, minimum=0)
        _positive("global_batch", self.global_batch, allow_none=True)
        _positive("per_replica_batch", self.per_replica_batch, allow_none=True)
        if self.global_batch is not None and self.per_replica_batch is not None:
            raise ConfigError(
                "Pass at most one of --global_batch (examples per optimizer step, "
                "over all replicas) or --per_replica_batch (examples per replica per "
                f"micro-batch). Received: --global_batch={self.global_batch}, "
                f"--per_replica_batch={self.per_replica_batch}"
            )
        if self.warmup_epochs is not None and self.warmup_steps is not None:
            raise ConfigError(
                "Pass at most one of --warmup_epochs and --warmup_steps. Received: "
                f"--warmup_epochs={self.warmup_epochs}, --warmup_steps={self.warmup_steps}"
            )
        if self.warmup_epochs is not None and not 0 <= self.warmup_epochs <= self.epochs:
            raise ConfigError(
                f"--warmup_epochs must be in [0, --epochs={self.epochs}]. "
                f"Received: --warmup_epochs={self.warmup_epochs}"
            )
        if self.collective_timeout is not None and (
                isinstance(self.collective_timeout, bool)
                or not isinstance(self.collective_timeout, (int, float))
                or not 0 < self.collective_timeout < float("inf")):
            raise ConfigError(
                "--collective_timeout must be a positive number of seconds (how long a "
                "collective waits for a stuck worker), or unset to wait forever. "
                f"Received: --collective_timeout={self.collective_timeout!r}")
        if not self.base_lr > 0:
            raise ConfigError(f"--base_lr must be > 0. Received: --base_lr={self.base_lr}")
        if self.weight_decay < 0:
            raise ConfigError(
                f"--weight_decay must be >= 0. Received: --weight_decay={self.weight_decay}"
            )
        if self.checkpoint_every is not None and self.model_dir is None:
            raise ConfigError(
                "--checkpoint_every needs --model_dir (where checkpoints go). "
                f"Received: --checkpoint_every={self.checkpoint_every} without --model_dir"
            )

    def _validate_local_steps(self) -> None:
        _positive("sync_every", self.sync_every, hint=" (1: synchronous training)")
        if self.outer_lr is not None and (
                isinstance(self.outer_lr, bool) or not isinstance(self.outer_lr, (int, float))
                or not 0 < self.outer_lr < float("inf")):
            raise ConfigError("--outer_lr must be a positive number (DiLoCo's outer learning "
                              f"rate; the paper uses 0.7). Received: --outer_lr={self.outer_lr!r}")
        if self.outer_momentum is not None:
            if self.outer_lr is None:
                raise ConfigError("--outer_momentum needs --outer_lr (DiLoCo's outer step). "
                                  f"Received: --outer_momentum={self.outer_momentum} alone")
            if not 0 <= self.outer_momentum < 1:
                raise ConfigError("--outer_momentum must be in [0, 1) (the paper uses 0.9). "
                                  f"Received: --outer_momentum={self.outer_momentum!r}")
        local = self.sync_every > 1 or self.outer_lr is not None
        if self.overlap_sync and not local:
            raise ConfigError(
                "--overlap_sync needs local steps: pass --sync_every=N > 1 (local SGD) or "
                "--outer_lr (DiLoCo); synchronous training has no window for the weights' "
                "all-reduce to overlap. Received: --overlap_sync alone")
        if local and self.shard_optimizer_state:
            raise ConfigError(
                f"--shard_optimizer_state cannot be combined with --sync_every={self.sync_every}"
                + (" and --outer_lr" if self.outer_lr is not None else "")
                + ": between synchronisations every replica updates all of its weights with "
                "its own optimizer slots, so there is no state to share out. Drop one of them. "
                f"Received: --shard_optimizer_state, --sync_every={self.sync_every}, "
                f"--outer_lr={self.outer_lr}")
        if local and (self.gradient_compression != "none" or self.all_reduce_dtype is not None):
            flag = (f"--gradient_compression={self.gradient_compression}"
                    if self.gradient_compression != "none"
                    else f"--all_reduce_dtype={self.all_reduce_dtype}")
            raise ConfigError(
                f"{flag} cannot be combined with --sync_every={self.sync_every}"
                + (" and --outer_lr" if self.outer_lr is not None else "")
                + ": local steps make no gradient all-reduce to compress (the weights are "
                "averaged exactly). Drop one of them. Received: "
                f"{flag}, --sync_every={self.sync_every}, --outer_lr={self.outer_lr}")

    def _validate_balance_batches(self) -> None:
        """The pairs `tfdp.training.option_rules` refuses with balance_batches, by flag."""
        if not isinstance(self.balance_batches, bool):
            raise ConfigError("--balance_batches must be true or false. "
                              f"Received: --balance_batches={self.balance_batches!r}")
        if not self.balance_batches:
            return
        local = self.sync_every > 1 or self.outer_lr is not None
        refused = (
            (self.accum_steps > 1, f"--accum_steps={self.accum_steps}",
             "a worker's share follows its speed, so it need not split into equal "
             "micro-batches; the shares are the memory knob"),
            (local, f"--sync_every={self.sync_every}"
             + (f" --outer_lr={self.outer_lr}" if self.outer_lr is not None else ""),
             "local steps make no gradient all-reduce per step for the shares to complete or "
             "the timings to ride in"),
            (self.gradient_compression != "none",
             f"--gradient_compression={self.gradient_compression}",
             "the workers' compute seconds ride, exactly in float32, in the plain gradient "
             "all-reduce, which a compressed sum replaces"),
            (self.all_reduce_dtype is not None, f"--all_reduce_dtype={self.all_reduce_dtype}",
             "the workers' compute seconds ride, exactly in float32, in the plain gradient "
             "all-reduce, which a 16-bit sum replaces"),
            (self.shard_optimizer_state, "--shard_optimizer_state",
             "ZeRO-1 reduce-scatters the gradients, and the compute seconds ride only in the "
             "plain all-reduce"),
            (self.jit_compile, "--jit_compile",
             "each worker times its step with tf.timestamp, which XLA cannot compile"),
            (self.loss_normalization != "global",
             f"--loss_normalization={self.loss_normalization}",
             "each worker's own mean, averaged, would weigh the examples of a small share "
             "more than those of a large one, so the result would depend on the plan"),
        )
        for applies, flag, why in refused:
            if applies:
                raise ConfigError(f"--balance_batches cannot be combined with {flag}: {why}. "
                                  f"Drop one of them. Received: --balance_batches {flag}")

    def model_arguments(self) -> dict:
        """The model builder's options these flags set (`remat`, `sync_bn`), only those on."""
        return {name: True for name in ("remat", "sync_bn") if getattr(self, name)}

    def outer_optimizer_argument(self):
        """What `tfdp.compile` / `Trainer` take as `outer_optimizer`: DiLoCo's, or None. Call in the strategy's scope."""
        if self.outer_lr is None:
            return None
        from tfdp.distribute import local_sync  # pylint: disable=import-outside-toplevel

        momentum = 0.9 if self.outer_momentum is None else self.outer_momentum
        return local_sync.diloco_outer_optimizer(self.outer_lr, momentum)

    def gradient_compression_argument(self):
        """What `tfdp.compile` / `Trainer` take as `gradient_compression` for these flags."""
        if self.gradient_compression == "none":
            return None
        if self.gradient_compression in ("bfloat16", "float8"):
            return self.gradient_compression
        from tfdp import compression  # pylint: disable=import-outside-toplevel

        if self.gradient_compression == "powersgd":
            return compression.PowerSGD(rank=self.compression_rank)
        return compression.TopK(fraction=self.topk_fraction)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _choice(name, value, choices):
    if value not in choices:
        raise ConfigError(
            f"--{name} must be one of {', '.join(choices)}. Received: --{name}={value!r}"
        )


def _positive(name, value, *, allow_none=False, minimum=1, hint=""):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"--{name} must be an integer >= {minimum}{hint}. Received: --{name}={value!r}"
        )
