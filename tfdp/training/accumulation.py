"""Gradient accumulation for `model.fit`, under any `tf.distribute` strategy.

Keras 3's own `gradient_accumulation_steps` fails under MirroredStrategy
(`RuntimeError: merge_call called while defining a new graph` from a `Cond`
around the optimizer update; keras-team/keras#20582), and where it runs it
still steps through the optimizer's all-reduce machinery once per micro-batch.
tfdp accumulates inside the replica's train step instead:

1. each replica splits its share of the global batch into `accum_steps`
   micro-batches and runs forward and backward on one at a time (a
   `tf.while_loop` with `parallel_iterations=1`, so only one micro-batch's
   activations are alive);
2. the micro-batch gradients are summed in local tensors, never reduced;
3. after the loop, the mean of the micro-batch gradients goes to
   `optimizer.apply_gradients` once: one all-reduce and one optimizer update
   per global batch.

Each micro-batch loss is Keras' mean over the micro-batch divided by the
number of replicas; averaging over `accum_steps` micro-batches and summing over
replicas gives the mean over the global batch. Regularisation losses are added
once per micro-batch and so count once per step after the average: the result
does not depend on the number of replicas or on `accum_steps`.

This module owns the accumulating train step and `compile`; batch arithmetic is
in `tfdp.training.batch`, datasets in `pipelines`, skipping steps with a NaN or Inf loss
or gradient (on by default) in `tfdp.training.nonfinite`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfdp import _checks
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training import step_monitor
from tfdp.distribute import devices
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp._upstream import keras_train_function
from tfdp._upstream import keras_train_step


def _split_micro_batches(data: Any, accum_steps: int) -> Any:
    """Reshapes every tensor of `data` from [B, ...] to [accum_steps, B / accum_steps, ...]."""
    tensors = [t for t in tf.nest.flatten(data) if t is not None]
    message = (
        f"tfdp.compile(accum_steps={accum_steps}): a replica's share of the "
        f"global batch does not split into {accum_steps} equal micro-batches. "
        f"Batch the dataset with drop_remainder=True and a global batch that "
        f"is a multiple of num_replicas × accum_steps (see tfdp.BatchConfig)."
    )
    static_batch = tensors[0].shape[0]
    if static_batch is not None and static_batch % accum_steps:
        raise ValueError(f"{message} Received a replica batch of {static_batch} examples.")
    replica_batch = tf.shape(tensors[0])[0]
    check = tf.debugging.assert_equal(replica_batch % accum_steps, 0, message=message)
    with tf.control_dependencies([check]):
        micro = replica_batch // accum_steps

    def split(tensor):
        if tensor is None:
            return None
        shape = tf.shape(tensor)
        return tf.reshape(tensor, tf.concat([[accum_steps, micro], shape[1:]], axis=0))

    return tf.nest.map_structure(split, data)


def _dense(gradient, variable):
    if gradient is None:
        return tf.zeros_like(variable)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def sum_micro_batch_gradients(
    data: Any,
    accum_steps: int,
    variables: Sequence[tf.Variable],
    loss_fn: Callable[[Any], tf.Tensor],
) -> list[tf.Tensor]:
    """Sums gradients over `accum_steps` micro-batches of `data`, one at a time.

    Runs in replica context and reduces nothing: the caller all-reduces the
    result once (through `optimizer.apply_gradients`).

    Args:
        data: a nest of tensors whose first dimension is the replica batch B,
            a multiple of `accum_steps` (`None` leaves are kept as `None`).
        accum_steps: micro-batches to split `data` into, each of B /
            accum_steps examples.
        variables: the variables to differentiate with respect to.
        loss_fn: maps one micro-batch (same nest as `data`) to the scalar loss
            to differentiate; it may update metrics as a side effect.

    Returns:
        One dense tensor per variable: the sum of the micro-batch gradients
        (zeros where a variable gets no gradient).
    """
    micro_batches = _split_micro_batches(data, accum_steps)

    def body(index, accumulated):
        micro_batch = tf.nest.map_structure(
            lambda t: None if t is None else t[index], micro_batches
        )
        with tf.GradientTape() as tape:
            loss = loss_fn(micro_batch)
        gradients = tape.gradient(loss, variables)
        return index + 1, [
            total + _dense(gradient, variable)
            for total, gradient, variable in zip(accumulated, gradients, variables)
        ]

    _, summed = tf.while_loop(
        lambda index, _: index < accum_steps,
        body,
        (tf.constant(0), [tf.zeros_like(v) for v in variables]),
        parallel_iterations=1,
    )
    return summed


def accumulating_train_step(model: keras.Model, accum_steps: int, data: Any) -> dict:
    """One optimizer step on one replica's share of a global batch.

    Runs inside `strategy.run`, like `keras.Model.train_step`.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        accum_steps: micro-batches to split `data` into.
        data: `(x, y, sample_weight)`-like replica batch of B examples, with B a
            multiple of `accum_steps`.

    Returns:
        The model's metric results, as `train_step` returns them.
    """
    variables = model.trainable_variables
    if not variables:
        warnings.warn("The model does not have any trainable weights.")
        return model.get_metrics_result()

    guarded = nonfinite_lib.guard_of(model.optimizer) is not None

    def micro_batch_loss(micro_batch):
        x, y, sample_weight = micro_batch
        y_pred, scaled_loss = keras_train_step.forward_and_loss(model, x, y, sample_weight)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if guarded:  # a non-finite loss makes a gradient NaN: the step is skipped
            scaled_loss = nonfinite_lib.fold_loss_into_gradients(scaled_loss, variables)
        return scaled_loss

    summed = sum_micro_batch_gradients(
        keras.utils.unpack_x_y_sample_weight(data), accum_steps, variables, micro_batch_loss
    )
    # Each micro-batch loss is a mean over its examples: average, don't sum.
    mean_gradients = [g / tf.cast(accum_steps, g.dtype) for g in summed]
    model.optimizer.apply_gradients(zip(mean_gradients, variables))
    return model.get_metrics_result()


def compile(  # pylint: disable=redefined-builtin
    model: keras.Model,
    *,
    optimizer,
    loss,
    metrics=None,
    accum_steps: int = 1,
    steps_per_execution: int = 1,
    jit_compile: bool = False,
    nonfinite: str | None = "skip",
    max_consecutive_nonfinite: int = nonfinite_lib.DEFAULT_MAX_CONSECUTIVE,
    all_reduce_dtype: str | None = None,
    **compile_kwargs,
) -> keras.Model:
    """`model.compile` with gradient accumulation that works under any strategy.

    After it, plain `model.fit` trains with one optimizer step (and one
    gradient all-reduce) per global batch; each replica's share of the global
    batch is processed in `accum_steps` micro-batches. Call it inside
    `strategy.scope()` as you would `model.compile`.

    **Non-finite steps.** With `nonfinite="skip"` (the default) the optimizer
    is wrapped (`tfdp.training.nonfinite.NonFiniteGuard`, or
    `NonFiniteLossScaleOptimizer` under `mixed_float16`): a step whose
    gradients (with `accum_steps > 1`, also loss) hold a NaN or Inf on any
    replica is skipped by every replica and worker alike, leaving weights,
    slots and `model.optimizer.iterations` unchanged, and counted in
    `model.optimizer.skipped_steps` (checkpointed with the optimizer). After
    `max_consecutive_nonfinite` in a row, `fit` raises
    `tfdp.training.nonfinite.NonFiniteError`. `"raise"` raises at the first (never
    applying it); `None` keeps Keras' behaviour. Keras still logs the loss of
    a skipped step (NaN) in the epoch's mean, what the forward pass updates
    (BatchNormalization moving statistics) is not undone, and
    `BackupAndRestore` counts it as a step (its position is in batches).

    Args:
        model: the Keras model.
        optimizer: a Keras optimizer instance or name. Must not set Keras'
            own `gradient_accumulation_steps` (use `accum_steps`).
        loss: the loss, as for `model.compile`.
        metrics: metrics, as for `model.compile`. Defaults to `None`.
        accum_steps: micro-batches per optimizer step; a replica's batch
            must be a multiple of it. Defaults to 1 (plain Keras train step).
        steps_per_execution: optimizer steps per `tf.function` call. Defaults
            to 1.
        jit_compile: compile the train step with XLA. Defaults to `False`.
        nonfinite: `"skip"`, `"raise"` or `None` (see above). Defaults to
            `"skip"`.
        max_consecutive_nonfinite: with `"skip"`, stop after this many
            skipped steps in a row. Defaults to 10.
        all_reduce_dtype: `None` (default) sums gradients over replicas in
            their own dtype; `"bfloat16"` all-reduces half the bytes, each
            sum rounded to about 3 significant digits (`tfdp.distribute.reduction`).
            Not with `nonfinite=None`.
        **compile_kwargs: passed on to `model.compile` (e.g. `loss_weights`).

    Returns:
        `model`, compiled.

    Raises:
        ValueError: `accum_steps` or `steps_per_execution` is not a positive
            integer, `nonfinite` or `max_consecutive_nonfinite` is invalid,
            the optimizer sets `gradient_accumulation_steps`, or
            `jit_compile=True` under a strategy where XLA cannot run (see
            `tfdp.distribute.devices.check_jit_compile_supported`).
    """
    _checks.check_int("accum_steps", accum_steps, hint=" (1 means no accumulation)")
    if (
        isinstance(steps_per_execution, bool)
        or not isinstance(steps_per_execution, int)
        or steps_per_execution < 1
    ):
        raise ValueError(
            "`steps_per_execution` must be a positive integer. "
            f"Received: steps_per_execution={steps_per_execution!r}"
        )
    nonfinite_lib.check_arguments(nonfinite, max_consecutive_nonfinite, all_reduce_dtype)
    if jit_compile:
        devices.check_jit_compile_supported(model.distribute_strategy)
    keras_accumulation = getattr(optimizer, "gradient_accumulation_steps", None)
    if keras_accumulation:
        raise ValueError(
            "The optimizer sets Keras' own `gradient_accumulation_steps="
            f"{keras_accumulation}`, which fails under tf.distribute strategies "
            "(keras-team/keras#20582). Remove it from the optimizer and pass "
            f"accum_steps={keras_accumulation} to tfdp.compile instead."
        )
    loss_scaling = model.dtype_policy.name == "mixed_float16" and compile_kwargs.get(
        "auto_scale_loss", True
    )
    if loss_scaling or nonfinite is not None or all_reduce_dtype is not None:
        # Under mixed_float16, what Keras' compile would do, with replicas
        # that agree on skipping an overflowing step (tfdp._upstream.loss_scale).
        optimizer = nonfinite_lib.wrap_optimizer(
            optimizer, nonfinite=nonfinite, max_consecutive_nonfinite=max_consecutive_nonfinite,
            loss_scaling=loss_scaling, all_reduce_dtype=all_reduce_dtype,
        )
    model.compile(
        optimizer=optimizer,
        loss=loss,
        metrics=metrics,
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
        **compile_kwargs,
    )
    if accum_steps > 1:
        # An instance attribute shadows Model.train_step; Keras looks the step
        # up on the instance each time it builds its train function.
        model.train_step = functools.partial(accumulating_train_step, model, accum_steps)
    elif "train_step" in vars(model):
        del model.train_step  # re-compiled without accumulation
    # steps_per_execution > 1: reduce the logs once per execution, not per step.
    keras_train_function.install(model, tfdp_step=accum_steps > 1)
    if nonfinite_lib.guard_of(model.optimizer) is not None:
        # After every execution: log skips, stop at the limit.
        step_monitor.install_fit_check(
            model, log=strategy_info_lib.strategy_info(model.distribute_strategy).is_chief
        )
    model.tfdp_accum_steps = accum_steps
    return model
