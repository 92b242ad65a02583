"""Gradient accumulation under any `tf.distribute` strategy: micro-batches, one all-reduce.

Keras 3's own `gradient_accumulation_steps` fails under MirroredStrategy
(`RuntimeError: merge_call called while defining a new graph` from a `Cond`
around the optimizer update; keras-team/keras#20582), and where it runs it
still steps through the optimizer's all-reduce machinery once per micro-batch.
tfdp accumulates inside the replica's train step instead
(`tfdp.training.train_step`):

1. each replica splits its share of the global batch into `accum_steps`
   micro-batches (`split_micro_batches`) and runs forward and backward on
   one at a time (a `tf.while_loop` with `parallel_iterations=1`, so only one
   micro-batch's activations are alive; `sum_micro_batch_gradients`). A
   model whose forward pass all-reduces (`BatchNormalization(synchronized=
   True)`, statistics per micro-batch over all replicas) gets the loop
   unrolled instead, each micro-batch ordered after the previous one's
   gradients: under MirroredStrategy that all-reduce is a `merge_call`,
   which TensorFlow refuses inside a `tf.while_loop` ("merge_call called
   while defining a new graph");
2. the micro-batch gradients are summed in local tensors, never reduced;
3. after the loop the sum goes to `optimizer.apply_gradients` once: one
   all-reduce and one optimizer update per global batch. A variable the loss
   does not depend on gets `None`, as without accumulation, so the
   optimizer leaves it alone as Keras does.

Each micro-batch's loss is already its part of the global batch's loss
(`tfdp.training.loss_normalization`), so the sums need no further scaling.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf


def split_micro_batches(data: Any, accum_steps: int) -> Any:
    """Reshapes every tensor of `data` from [B, ...] to [accum_steps, B / accum_steps, ...]."""
    tensors = [t for t in tf.nest.flatten(data) if t is not None]
    message = (
        f"accum_steps={accum_steps}: a replica's share of the "
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


def _dense(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def sum_micro_batch_gradients(
    data: Any,
    accum_steps: int,
    variables: Sequence[tf.Variable],
    loss_fn: Callable[[Any], tf.Tensor],
    on_gradients: Callable[[tf.Tensor, list], list] | None = None,
    unroll: bool = False,
) -> list[tf.Tensor | None]:
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
        on_gradients: `(loss, gradients) -> gradients`, applied to each
            micro-batch's gradients before they are summed (e.g.
            `nonfinite.fold_loss_into_gradients`). Defaults to None.
        unroll: trace the micro-batches one after another in Python instead
            of a `tf.while_loop` (for forward passes that hold collectives);
            each waits for the previous one's gradients, so at most one
            micro-batch's activations are alive, as in the loop. Defaults to
            False.

    Returns:
        One entry per variable: the sum of the micro-batch gradients as a
        dense tensor, or `None` where the loss does not depend on the
        variable, as `tape.gradient` gives without accumulation. The
        optimizer then leaves that variable alone, as Keras' own train step
        does (a zero gradient would still move it under momentum, Adam or
        weight decay).
    """
    micro_batches = split_micro_batches(data, accum_steps)
    # Which gradients are None is known when the loop body is traced (the
    # same for every micro-batch); such variables keep a zero sum in the loop
    # and are reported as None after it.
    unconnected: set[int] = set()

    def body(index, accumulated):
        micro_batch = tf.nest.map_structure(
            lambda t: None if t is None else t[index], micro_batches
        )
        with tf.GradientTape() as tape:
            loss = loss_fn(micro_batch)
        gradients = tape.gradient(loss, variables)
        if on_gradients is not None:
            gradients = on_gradients(loss, gradients)
        summed = []
        for i, (total, gradient) in enumerate(zip(accumulated, gradients)):
            if gradient is None:
                unconnected.add(i)
                summed.append(total)
            else:
                summed.append(total + _dense(gradient))
        return index + 1, summed

    zeros = [tf.zeros_like(v) for v in variables]
    if unroll:
        summed = zeros
        for index in range(accum_steps):
            with tf.control_dependencies(summed if index else []):
                _, summed = body(tf.constant(index), summed)
    else:
        _, summed = tf.while_loop(
            lambda index, _: index < accum_steps,
            body,
            (tf.constant(0), zeros),
            parallel_iterations=1,
        )
    return [None if i in unconnected else total for i, total in enumerate(summed)]
