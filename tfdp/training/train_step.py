"""One replica's train and evaluation step on its share of a global batch, as one device would take it.

`tfdp.compile` (for `model.fit`) and `tfdp.Trainer` both run these. A step:

1. splits the replica's batch into `accum_steps` micro-batches (1: the
   batch itself);
2. with `"global"` loss normalisation, counts what one device divides the
   loss by (examples, valid mask elements, sample-weight sums;
   `tfdp.training.loss_normalization`) and sums the counts over the replicas
   with one small all-reduce. With accumulation, the counts of all
   micro-batches are taken first (a cheap pass: the forward pass runs only
   when the predictions may carry a mask), so every micro-batch is
   normalised by the counts of the whole global batch;
3. runs forward and backward on each micro-batch in turn
   (`tfdp.training.accumulation`), summing gradients locally;
4. applies the summed gradients once: one gradient all-reduce and one
   optimizer update per global batch, skipped on every replica alike when
   not finite (`tfdp.training.nonfinite`).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from tfdp._upstream import keras_loss_terms
from tfdp.training import accumulation
from tfdp.training import loss_normalization as norm_lib
from tfdp.training import nonfinite as nonfinite_lib

#: `track(share, loss, denominators, term_losses, x, y, y_pred, sample_weight)`:
#: updates the loss and metric state after a share's forward pass.
Track = Callable[..., None]


def _forward(model: keras.Model, x, training: bool):
    if keras_loss_terms.call_has_training_arg(model):
        return model(x, training=training)
    return model(x)


def _static_predictions(model: keras.Model, x):
    """Zeros shaped like the model's predictions for `x`, or None if a shape is only known at run time."""
    specs = tf.nest.map_structure(
        lambda t: None if t is None else keras.KerasTensor([None] + list(t.shape[1:]), dtype=t.dtype),
        x,
    )
    try:
        outputs = model.compute_output_spec(specs)
    except Exception:  # pylint: disable=broad-except
        return None  # a model Keras cannot trace symbolically: run it
    batch = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
    zeros = []
    for spec in tf.nest.flatten(outputs):
        dims = list(spec.shape[1:])
        if any(d is None for d in dims):
            return None
        zeros.append(tf.zeros(tf.concat([[batch], tf.constant(dims, tf.int32)], 0), spec.dtype))
    return tf.nest.pack_sequence_as(outputs, zeros)


def _predictions_for_counts(model: keras.Model):
    """Maps x to predictions good enough to count with: zeros of the right shape unless masks matter."""
    needs_forward = keras_loss_terms.may_produce_mask(model)

    def predict(x):
        if not needs_forward:
            zeros = _static_predictions(model, x)
            if zeros is not None:
                return zeros
        return _forward(model, x, training=False)

    return predict


def global_micro_batch_counts(model, loss_source, normalizer, micro_batches, accum_steps):
    """The counts of the whole global batch, summed over micro-batches and replicas."""
    predict = _predictions_for_counts(model)

    def counts_of(micro_batch):
        mx, my, msw = micro_batch
        return loss_source.share(mx, my, predict(mx), msw).counts()

    first = counts_of(tf.nest.map_structure(lambda t: None if t is None else t[0], micro_batches))
    rest = tf.nest.map_structure(lambda t: None if t is None else t[1:], micro_batches)
    local = first + norm_lib.sum_counts(counts_of, rest, accum_steps - 1, first.shape[0])
    return normalizer.global_counts(local)


def replica_train_step(*, model: keras.Model, optimizer, loss_source, normalizer: norm_lib.Normalizer,
                       accum_steps: int, data: Any, track: Track) -> None:
    """One optimizer step on one replica's share of a global batch (inside `strategy.run`).

    Args:
        model: the model.
        optimizer: the optimizer to apply the gradients with.
        loss_source: `loss_normalization.ModelLoss` or `SingleLoss`.
        normalizer: the `loss_normalization.Normalizer`.
        accum_steps: micro-batches to split the replica's batch into.
        data: `(x, y, sample_weight)`-like replica batch.
        track: updates loss and metric state for each share.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    variables = model.trainable_variables
    guarded = nonfinite_lib.guard_of(optimizer) is not None

    def share_loss(mx, my, msw, global_counts):
        y_pred = _forward(model, mx, training=True)
        share = loss_source.share(mx, my, y_pred, msw)
        if normalizer.is_global and global_counts is None:
            global_counts = normalizer.global_counts(share.counts())
        denominators = normalizer.denominators(share, global_counts)
        loss, term_losses = normalizer.loss(share, denominators)
        track(share, loss, denominators, term_losses, mx, my, y_pred, msw)
        if guarded:  # a non-finite loss makes a gradient NaN: the step is skipped
            loss = nonfinite_lib.fold_loss_into_gradients(loss, variables)
        return optimizer.scale_loss(loss)

    if accum_steps == 1:
        with tf.GradientTape() as tape:
            scaled_loss = share_loss(x, y, sample_weight, None)
        gradients = tape.gradient(scaled_loss, variables)
    else:
        global_counts = None
        if normalizer.is_global:
            global_counts = global_micro_batch_counts(
                model, loss_source, normalizer,
                accumulation.split_micro_batches((x, y, sample_weight), accum_steps), accum_steps,
            )
        gradients = accumulation.sum_micro_batch_gradients(
            (x, y, sample_weight), accum_steps, variables,
            lambda micro_batch: share_loss(*micro_batch, global_counts),
        )
    # Each share's loss is already its part of the global batch's loss: the
    # all-reduce SUM inside apply_gradients completes it.
    optimizer.apply_gradients(zip(gradients, variables))


def replica_eval_step(*, model: keras.Model, loss_source, normalizer: norm_lib.Normalizer,
                      data: Any, track: Track) -> None:
    """One evaluation step on one replica's share of a global batch (inside `strategy.run`)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = _forward(model, x, training=False)
    share = loss_source.share(x, y, y_pred, sample_weight)
    global_counts = normalizer.global_counts(share.counts()) if normalizer.is_global else None
    denominators = normalizer.denominators(share, global_counts)
    loss, term_losses = normalizer.loss(share, denominators)
    track(share, loss, denominators, term_losses, x, y, y_pred, sample_weight)
