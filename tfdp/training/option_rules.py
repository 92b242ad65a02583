"""The rules for combining training options: which pairs tfdp refuses, and what to use instead.

`tfdp.compile` and `tfdp.Trainer` gather their gradient-path options into one
`TrainingOptions` and call `check` before they build any variable or
`tf.function`, so a combination that cannot work costs a second, not a
crashed first step or a hung cluster. The optimizer wrappers of
`tfdp.training.nonfinite` call it too (for the options they hold), so a
wrapper built by hand or from a saved config obeys the same rules.

This module owns the *pairs* only: one table, `RULES`, one row per refused
pair, each naming both options and saying what to use instead. Each value
alone is checked where it is defined (`tfdp.distribute.reduction` for
`all_reduce_dtype`, `tfdp.distribute.compression` for
`gradient_compression`, `tfdp.distribute.local_sync` for `sync_every`,
`tfdp.distribute.optimizer_sharding` for which optimizers ZeRO-1 can
shard, `tfdp.distribute.devices` for where `jit_compile` runs), as is the
alias conflict `gradient_compression="bfloat16"` with another
`all_reduce_dtype` (`compression.resolve`).

Every pair of the options below that no rule refuses trains, on 2 replicas,
and where a reference exists equals it (tests/training/test_option_pairs.py;
`balance_batches`' rows and the pairs it trains with are checked in
tests/training/test_balanced_batches.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tfdp.distribute import compression


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """The options whose combinations are checked, as `tfdp.compile` receives them.

    Attributes:
        nonfinite: `"skip"`, `"raise"` or `None`. Defaults to `"skip"`.
        all_reduce_dtype: `None` or `"bfloat16"` (also what
            `gradient_compression="bfloat16"` resolves to). Defaults to `None`.
        compressor: a `tfdp.compression` compressor, or `None`. Defaults to
            `None`.
        sync_every: local optimizer steps between synchronisations. Defaults
            to 1 (synchronous).
        outer_optimizer: DiLoCo's outer optimizer, or `None`. Defaults to
            `None`.
        overlap_sync: local steps whose all-reduce overlaps the next
            window (`tfdp.distribute.overlapped_sync`). Defaults to False.
        shard_optimizer_state: ZeRO-1. Defaults to False.
        accum_steps: micro-batches per optimizer step. Defaults to 1.
        steps_per_execution: optimizer steps per `tf.function` call
            (`Trainer`'s `steps_per_loop`). Defaults to 1.
        loss_scaling: dynamic loss scaling (the `mixed_float16` policy).
            Defaults to False.
        jit_compile: XLA. Defaults to False.
        optimizer: the (inner) Keras optimizer, or `None` when unknown.
        balance_batches: balanced per-replica batches
            (`tfdp.training.balanced_batches`) on 2+ replicas. Defaults to
            False.
        bucket_cap_mb: `None`, or MiB per gradient bucket all-reduced during
            the backward pass (`tfdp.training.exchanges.bucketed`). Defaults
            to `None`.
    """

    nonfinite: str | None = "skip"
    all_reduce_dtype: str | None = None
    compressor: Any = None
    sync_every: int = 1
    outer_optimizer: Any = None
    overlap_sync: bool = False
    shard_optimizer_state: bool = False
    accum_steps: int = 1
    steps_per_execution: int = 1
    loss_scaling: bool = False
    jit_compile: bool = False
    optimizer: Any = None
    balance_batches: bool = False
    bucket_cap_mb: float | None = None

    @property
    def steps_locally(self) -> bool:
        """Local SGD or DiLoCo: each replica applies its own gradients."""
        return self.sync_every > 1 or self.outer_optimizer is not None

    @property
    def local_steps(self) -> str:
        """How the user asked for local steps, e.g. `"sync_every=8 with an outer_optimizer"`."""
        outer = self.outer_optimizer is not None
        if self.sync_every == 1 and outer:
            return "outer_optimizer (DiLoCo, sync_every=1)"
        return f"sync_every={self.sync_every}" + (" with an outer_optimizer" if outer else "")

    @property
    def gradient_sum(self) -> str:
        """The gradient compression asked for, as the user wrote it."""
        name = getattr(self.compressor, "option_name", None)
        if name is not None:  # as the user may have written it: "float8"
            return f"gradient_compression={name!r}"
        if self.compressor is not None:
            return f"gradient_compression={self.compressor!r}"
        return (f"all_reduce_dtype={self.all_reduce_dtype!r} "
                f"(or gradient_compression={self.all_reduce_dtype!r})")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One refused pair: `first` with `second`, when `applies`; `why` and `instead` finish the message."""

    first: str
    second: str
    applies: Callable[[TrainingOptions], bool]
    why: str
    instead: str

    def message(self, options: TrainingOptions) -> str:
        """The ValueError's text: both options as received, the reason, the fix."""
        return (f"{self.first.format(o=options)} cannot be combined with "
                f"{self.second.format(o=options)}: {self.why.format(o=options)} "
                f"{self.instead}")


_NEEDS_WRAPPER = ("runs inside tfdp's optimizer wrapper, which comes with the non-finite "
                  "step handling that nonfinite=None turns off.")
_KEEP_WRAPPER = "Use nonfinite='skip' (the default) or 'raise', or drop {}."

#: Every refused pair. Checked in this order; the first that applies raises.
RULES: tuple[Rule, ...] = (
    Rule("nonfinite=None", "{o.gradient_sum}",
         lambda o: o.nonfinite is None and (o.compressor is not None
                                            or o.all_reduce_dtype is not None),
         "the gradient reduction " + _NEEDS_WRAPPER,
         _KEEP_WRAPPER.format("the gradient compression")),
    Rule("nonfinite=None", "{o.local_steps}",
         lambda o: o.nonfinite is None and o.steps_locally,
         "the synchronisation of local steps " + _NEEDS_WRAPPER,
         _KEEP_WRAPPER.format("sync_every and outer_optimizer")),
    Rule("nonfinite=None", "shard_optimizer_state=True",
         lambda o: o.nonfinite is None and o.shard_optimizer_state,
         "ZeRO-1 " + _NEEDS_WRAPPER,
         _KEEP_WRAPPER.format("shard_optimizer_state")),
    Rule("{o.local_steps}", "{o.gradient_sum}",
         lambda o: o.steps_locally and (o.compressor is not None
                                        or o.all_reduce_dtype is not None),
         "local steps make no gradient all-reduce, so there is nothing to compress (the "
         "weights are averaged exactly, in float32).",
         "Use gradient_compression=None and all_reduce_dtype=None with local steps, or "
         "sync_every=1 and no outer_optimizer to compress synchronous training."),
    Rule("{o.gradient_sum}", "all_reduce_dtype={o.all_reduce_dtype!r}",
         lambda o: (o.all_reduce_dtype is not None
                    and isinstance(o.compressor, compression.GradientCompressor)
                    and o.compressor.wire_dtype is not None),
         "the compressor always sends its own {o.compressor.wire_dtype} values, so the dtype "
         "would be ignored.",
         "Use it alone. Pass all_reduce_dtype=None with it."),
    Rule("balance_batches=True", "nonfinite=None",
         lambda o: o.balance_batches and o.nonfinite is None,
         "the replicas' compute seconds ride in the gradient all-reduce of tfdp's optimizer "
         "wrapper, which comes with the non-finite step handling that nonfinite=None turns "
         "off.",
         "Use nonfinite='skip' (the default) or 'raise', or balance_batches=False."),
    Rule("balance_batches=True", "accum_steps={o.accum_steps}",
         lambda o: o.balance_batches and o.accum_steps > 1,
         "a replica's share follows its speed, so it need not split into accum_steps "
         "equal micro-batches.",
         "Use accum_steps=1 with balance_batches (the shares are the memory knob: each "
         "replica computes only its own), or balance_batches=False to accumulate."),
    Rule("balance_batches=True", "{o.local_steps}",
         lambda o: o.balance_batches and o.steps_locally,
         "local steps make no gradient all-reduce per step for the shares to complete or the "
         "timings to ride in.",
         "Use sync_every=1 and no outer_optimizer with balance_batches, or "
         "balance_batches=False for local steps."),
    Rule("balance_batches=True", "{o.gradient_sum}",
         lambda o: o.balance_batches and (o.compressor is not None
                                          or o.all_reduce_dtype is not None),
         "the replicas' compute seconds ride, exactly in float32, in the plain all-reduce of "
         "the gradients, which a compressed or 16-bit sum replaces.",
         "Use gradient_compression=None and all_reduce_dtype=None with balance_batches, or "
         "balance_batches=False to compress."),
    Rule("balance_batches=True", "shard_optimizer_state=True",
         lambda o: o.balance_batches and o.shard_optimizer_state,
         "ZeRO-1 reduce-scatters the gradients, and the replicas' compute seconds ride only "
         "in the plain all-reduce.",
         "Use shard_optimizer_state=False with balance_batches, or balance_batches=False to "
         "shard the optimizer state."),
    Rule("balance_batches=True", "jit_compile=True",
         lambda o: o.balance_batches and o.jit_compile,
         "each replica times its step with tf.timestamp, which XLA cannot compile.",
         "Use jit_compile=False with balance_batches, or balance_batches=False to compile "
         "with XLA."),
    Rule("overlap_sync=True", "sync_every=1 and no outer_optimizer",
         lambda o: o.overlap_sync and not o.steps_locally,
         "there is no window for the all-reduce to overlap: synchronous training all-reduces "
         "the gradients of every step.",
         "Use sync_every > 1 or an outer_optimizer with overlap_sync=True, or "
         "overlap_sync=False."),
    Rule("overlap_sync=True", "steps_per_execution={o.steps_per_execution} (steps_per_loop)",
         lambda o: (o.overlap_sync and o.steps_locally
                    and o.sync_every % o.steps_per_execution != 0),
         "an overlapped window ends between calls of the train function, so a call of "
         "{o.steps_per_execution} steps would stretch windows of sync_every={o.sync_every}.",
         "Use a steps_per_execution that divides sync_every, or overlap_sync=False."),
    Rule("nonfinite=None", "bucket_cap_mb={o.bucket_cap_mb!r}",
         lambda o: o.nonfinite is None and o.bucket_cap_mb is not None,
         "the bucketed all-reduce " + _NEEDS_WRAPPER,
         _KEEP_WRAPPER.format("bucket_cap_mb")),
    Rule("bucket_cap_mb={o.bucket_cap_mb!r}", "{o.local_steps}",
         lambda o: o.bucket_cap_mb is not None and o.steps_locally,
         "local steps make no gradient all-reduce to cut into buckets.",
         "Use bucket_cap_mb=None with local steps, or sync_every=1 and no outer_optimizer "
         "to all-reduce in buckets."),
    Rule("bucket_cap_mb={o.bucket_cap_mb!r}", "{o.gradient_sum}",
         lambda o: o.bucket_cap_mb is not None and o.compressor is not None,
         "the compressor sends its own collectives, which the buckets would not cut.",
         "Use bucket_cap_mb=None with gradient_compression, or gradient_compression=None to "
         "all-reduce in buckets (all_reduce_dtype='bfloat16' combines with them)."),
    Rule("bucket_cap_mb={o.bucket_cap_mb!r}", "shard_optimizer_state=True",
         lambda o: o.bucket_cap_mb is not None and o.shard_optimizer_state,
         "ZeRO-1 reduce-scatters all the gradients in one collective after the backward pass.",
         "Use bucket_cap_mb=None with shard_optimizer_state, or shard_optimizer_state=False "
         "to all-reduce in buckets."),
    Rule("{o.local_steps}", "shard_optimizer_state=True",
         lambda o: o.steps_locally and o.shard_optimizer_state,
         "between synchronisations every replica updates all of its own weights with its "
         "own slots, so there is no optimizer state to share out.",
         "Use shard_optimizer_state=False with local steps, or sync_every=1 and no "
         "outer_optimizer to shard synchronous training."),
)


def refusal(options: TrainingOptions) -> str | None:
    """The message of the first rule `options` break, or None when they may train together."""
    for rule in RULES:
        if rule.applies(options):
            return rule.message(options)
    return None


def check(options: TrainingOptions) -> None:
    """Raises unless every pair of `options` may be combined.

    Call before building anything (variables, optimizer wrappers,
    `tf.function`s).

    Args:
        options: the training options, each already valid on its own.

    Raises:
        ValueError: a pair in `RULES` applies; the message names both
            options, as received, says why and what to use instead.
    """
    message = refusal(options)
    if message is not None:
        raise ValueError(message)
