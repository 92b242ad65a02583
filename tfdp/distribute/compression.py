"""Gradient compressors: what a replica sends instead of its whole gradient.

A compressor replaces the one batched all-reduce SUM of the gradients
(`tfdp.distribute.reduction.all_reduce_sum`) inside tfdp's optimizer
wrappers (`tfdp.training.exchanges.compressed`). Each replica hands it its share of the
gradient (the shares sum to the global batch's gradient, as tfdp's train
steps make them); it returns, identically on every replica, an estimate of
that sum, and keeps what the estimate left out in per-replica *error
feedback* memory that is added to the next step's share, so that nothing is
lost for good (Seide et al. 2014; Karimireddy et al. 2019).

State lives in `tf.Variable`s that are synchronised on read
(`SyncOnReadVariable` under a strategy): every replica updates its own copy
without a collective. The wrappers build them with the optimizer and commit
a step's new state only when the step is applied, so a skipped non-finite
step leaves the memories as they were.

This module holds the protocol and the argument checks; `powersgd.py`,
`topk.py` and `float8.py` the compressors, each registered by subclassing
`GradientCompressor` (by class name for optimizer configs, and by
`option_name` for a `gradient_compression` string).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

#: String values of `gradient_compression` that set `all_reduce_dtype`.
NAMES = ("bfloat16",)
#: Compressor classes by class name (optimizer configs) and by `option_name`.
REGISTERED: dict = {}
NAMED: dict = {}


class GradientCompressor:
    """Base class: `build`, then once per step `reduce` and `commit`.

    Subclasses implement `_build`, `reduce` and `values_sent`, and set
    `state` (a list of variables) in `_build`.
    """

    #: Per-replica state variables, in the order `reduce` returns new values.
    state: list
    #: The `gradient_compression` string that makes one with no arguments, or None.
    option_name: str | None = None
    #: The dtype it always sends its values in (then `all_reduce_dtype` is
    #: refused with it: `tfdp.training.option_rules`), or None: it sends in
    #: `all_reduce_dtype`.
    wire_dtype: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        REGISTERED[cls.__name__] = cls
        if cls.option_name is not None:
            NAMED[cls.option_name] = cls

    def __init__(self):
        self.state = []
        self._built_for: tuple | None = None

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Creates the per-replica state for `variables` (inside the strategy's scope)."""
        shapes = tuple(tuple(v.shape) for v in variables)
        if self._built_for is not None:
            if shapes != self._built_for:
                raise ValueError(
                    f"{type(self).__name__} was built for other variables; use one "
                    "compressor object per optimizer."
                )
            return
        self._built_for = shapes
        self._build(list(variables))

    def _build(self, variables: list) -> None:
        raise NotImplementedError

    def reduce(self, context: tf.distribute.ReplicaContext, gradients: list,
               all_reduce_dtype: str | None = None):
        """The estimated sum of `gradients` over replicas, and this replica's new state.

        Args:
            context: the replica context.
            gradients: this replica's share of each gradient, one dense
                tensor per variable given to `build`, in that order; None
                for a variable without a gradient this step (the same on
                every replica), whose state must stay as it is.
            all_reduce_dtype: `None` or `"bfloat16"`: the dtype of every
                floating-point value the compressor sends (a compressor must
                use it, not ignore it); the rounding goes into its error
                feedback.

        Returns:
            `(sums, new_state)`: the estimates (equal on every replica, each
            in its gradient's shape and dtype; None where the gradient was None) and a list of tensors, one per
            variable of `state`, to `commit`.
        """
        raise NotImplementedError

    def commit(self, new_state: Sequence[tf.Tensor], applied: tf.Tensor) -> None:
        """Stores `new_state` where `applied` (a bool scalar, equal on every replica)."""
        for variable, value in zip(self.state, new_state):
            variable.assign(tf.where(applied, value, variable.read_value()))

    def values_sent(self, variables: Sequence[tf.Variable]) -> int:
        """Values (of 4 bytes) each replica contributes to the collectives per step."""
        raise NotImplementedError

    def get_config(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


def state_variable(initial_value: Any, name: str) -> tf.Variable:
    """A variable each replica reads and writes on its own (no collective).

    Not an optimizer variable: neither the chief's `tf.train.Checkpoint` nor
    a `.keras` file holds it. tfdp's checkpoints (`tfdp.Trainer(model_dir=...)`,
    `tfdp.callbacks.BackupAndRestore`) save every replica's copy beside them
    and restore each replica's own (`tfdp.training.replica_state`, as the
    compressed exchange declares it in `state_variables`). Keras' savers
    (`model.save`, `keras.callbacks.ModelCheckpoint`,
    `keras.callbacks.BackupAndRestore`) keep none of it, and tfdp warns,
    naming the saver (`tfdp.training.keras_savers`).
    """
    return tf.Variable(
        initial_value, trainable=False, name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def check(gradient_compression) -> None:
    """Raises ValueError unless `gradient_compression` is None, a name in `NAMES` or a compressor."""
    if gradient_compression is None or isinstance(gradient_compression, GradientCompressor):
        return
    if isinstance(gradient_compression, str) and (gradient_compression in NAMES
                                                  or gradient_compression in NAMED):
        return
    raise ValueError(
        "`gradient_compression` must be None (all-reduce the gradients as they are), "
        "'bfloat16' (sum them in bfloat16: half the bytes), 'float8' (8-bit floats with "
        "a per-tensor scale and error feedback: a quarter of the bytes), "
        "tfdp.compression.PowerSGD(rank=...) or tfdp.compression.TopK(fraction=...). "
        f"Received: gradient_compression={gradient_compression!r}"
    )


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be an integer ≥ 1. Received: {name}={value!r}")


def check_fraction(name: str, value) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 < value <= 1):
        raise ValueError(f"`{name}` must be a number in (0, 1]. Received: {name}={value!r}")


def resolve(gradient_compression, all_reduce_dtype: str | None = None):
    """`(all_reduce_dtype, compressor)` for the `gradient_compression` argument.

    `"bfloat16"` is `all_reduce_dtype="bfloat16"` (which stays as an alias);
    a compressor object sends its values in `all_reduce_dtype` (PowerSGD its
    P and Q factors and the tensors it does not compress, Top-K its values).

    Raises:
        ValueError: `gradient_compression` is invalid, or says `"bfloat16"`
            while `all_reduce_dtype` says otherwise.
    """
    check(gradient_compression)
    if gradient_compression is None or isinstance(gradient_compression, GradientCompressor):
        return all_reduce_dtype, gradient_compression
    if gradient_compression in NAMED:
        if all_reduce_dtype is not None:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} cannot be combined with "
                f"all_reduce_dtype={all_reduce_dtype!r}: it sends its own {gradient_compression} "
                "values, so the dtype would be ignored. Use gradient_compression="
                f"{gradient_compression!r} alone (all_reduce_dtype=None), or "
                "gradient_compression='bfloat16' for 16-bit sums.")
        return None, NAMED[gradient_compression]()
    if all_reduce_dtype not in (None, gradient_compression):
        raise ValueError(
            f"gradient_compression={gradient_compression!r} and "
            f"all_reduce_dtype={all_reduce_dtype!r} disagree; pass only gradient_compression."
        )
    return gradient_compression, None
