"""One replica's train and evaluation step on its share of a global batch, as one device would take it.

`tfdp.compile` (for `model.fit`) and `tfdp.Trainer` both run these. A step:

1. splits the replica's batch into `accum_steps` micro-batches (1: the
   batch itself);
2. with `"global"` loss normalisation, counts what one device divides the
   loss by (examples, valid mask elements, sample-weight sums;
   `tfdp.training.loss_normalization`) and sums the counts over the replicas
   with one small all-reduce. The counts depend on the predictions only
   through their static shapes unless the model may put a mask on them, so
   they are usually taken before the forward pass (from zeros of the
   predictions' shape). With a static batch (`drop_remainder`) and counts
   that follow from it (no mask, no `"mean_with_sample_weight"` weights),
   they are constants and nothing is all-reduced. When every count is the
   examples times a constant but the batch is dynamic (as under
   MultiWorkerMirroredStrategy), the global examples ride in the gradients'
   own all-reduce and divide the summed gradients (deferred). Otherwise (a
   mask, weight sums) one small all-reduce of the counts, after the forward
   pass under a mask. With accumulation, the
   counts of all micro-batches are taken first (with a mask, from a forward
   pass in inference mode), so every micro-batch is normalised by the counts
   of the whole global batch;
3. runs forward and backward on each micro-batch in turn
   (`tfdp.training.accumulation`), summing gradients locally;
4. applies the summed gradients once: one gradient all-reduce and one
   optimizer update per global batch, skipped on every replica alike when
   not finite (`tfdp.training.nonfinite`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras
import tensorflow as tf

from tfdp._upstream import keras_loss_terms
from tfdp._upstream import numpy_aliased_inputs
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


def _counting_predictions(model: keras.Model, x):
    """Zeros shaped like the predictions for `x` when the counts need no forward pass, else None.

    Counts depend on the predictions only through their shapes, unless the
    model may put a Keras mask on them.
    """
    if keras_loss_terms.may_produce_mask(model):
        return None
    return _static_predictions(model, x)


def _static_examples(x) -> int | None:
    return next(t for t in tf.nest.flatten(x) if t is not None).shape[0]


def _local_examples(x) -> tf.Tensor:
    return tf.cast(tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0], tf.float32)


def _settle_counts(normalizer, share, static_examples, can_defer, local_counts):
    """`(global counts, deferred)`: constants, counts per example (deferred), or all-reduced."""
    static = normalizer.static_global_counts(share, static_examples)
    if static is not None:
        return static, False
    if can_defer:
        deferred = normalizer.deferred_counts(share)
        if deferred is not None:
            return deferred, True
    return normalizer.global_counts(local_counts()), False


def _replica_batch(data):
    """`(x, y, sample_weight)` of a replica's batch, in memory the step may write to.

    Under several CPU replicas the batch can be slices of the caller's NumPy
    arrays, which TensorFlow would overwrite (`numpy_aliased_inputs`).
    """
    if numpy_aliased_inputs.needed():
        data = numpy_aliased_inputs.own_inputs(data)
    return keras.utils.unpack_x_y_sample_weight(data)


def counts_before_forward(model, loss_source, normalizer, x, y, sample_weight, can_defer=False):
    """The global counts of a whole replica batch, known before its forward pass.

    From the data and the predictions' static shapes: constants when the
    batch is static and every count follows from it
    (`Normalizer.static_global_counts`); with `can_defer`, counts per global
    example when every count is proportional to the examples (the examples
    then ride in the gradients' all-reduce); else one all-reduce that does
    not wait for the forward pass.

    Returns:
        `(global counts, deferred)`; `(None, False)` when the counts need
        the predictions themselves (a mask), or under `"per_replica"`.
    """
    if not normalizer.is_global:
        return None, False
    predictions = _counting_predictions(model, x)
    if predictions is None:
        return None, False
    share = loss_source.share(x, y, predictions, sample_weight, counting=True)
    return _settle_counts(normalizer, share, _static_examples(x), can_defer, share.counts)


def global_micro_batch_counts(model, loss_source, normalizer, micro_batches, accum_steps,
                              can_defer=False):
    """The counts of the whole global batch, as `counts_before_forward`, over micro-batches.

    Constants or deferred counts when they follow from shapes; otherwise a
    pass over the micro-batches (with a forward pass in inference mode only
    under a mask) and one all-reduce.
    """

    def share_of(micro_batch):
        mx, my, msw = micro_batch
        predictions = _counting_predictions(model, mx)
        if predictions is None:
            predictions = _forward(model, mx, training=False)
        return loss_source.share(mx, my, predictions, msw, counting=True)

    first_batch = tf.nest.map_structure(lambda t: None if t is None else t[0], micro_batches)
    first = share_of(first_batch)

    def local_counts():
        rest = tf.nest.map_structure(lambda t: None if t is None else t[1:], micro_batches)
        counts = first.counts()
        return counts + norm_lib.sum_counts(lambda mb: share_of(mb).counts(), rest,
                                            accum_steps - 1, counts.shape[0])

    return _settle_counts(normalizer, first, _static_examples(first_batch[0]), can_defer,
                          local_counts)


def train_normalizer(loss_normalization: str, num_replicas: int, accum_steps: int,
                     steps_locally: bool = False) -> norm_lib.Normalizer:
    """The train step's normaliser; with local steps (local SGD, DiLoCo) each replica's loss is
    its own batch's mean, as on one device with that batch, with no collective."""
    if steps_locally:
        return norm_lib.Normalizer(norm_lib.PER_REPLICA, 1, accum_steps)
    return norm_lib.Normalizer(loss_normalization, num_replicas, accum_steps)


def replica_train_step(*, model: keras.Model, optimizer, loss_source, normalizer: norm_lib.Normalizer,
                       accum_steps: int, data: Any, track: Track, balance=None) -> None:
    """One optimizer step on one replica's share of a global batch (inside `strategy.run`).

    Args:
        model: the model.
        optimizer: the optimizer to apply the gradients with.
        loss_source: `loss_normalization.ModelLoss` or `SingleLoss`.
        normalizer: the `loss_normalization.Normalizer`.
        accum_steps: micro-batches to split the replica's batch into.
        data: `(x, y, sample_weight)`-like replica batch; with `balance`,
            the whole global batch.
        track: updates loss and metric state for each share.
        balance: `None`, or the `balanced_batches.BalancedBatches`: the
            replica computes its slice of `data` by the plan, timed, and its
            seconds ride in the gradients' all-reduce (`accum_steps` 1 and
            an optimizer that `carries_riders` only: `option_rules`).
    """
    clock = None
    if balance is not None:
        data, clock = balance.start_clock(balance.replica_slice(data))
    x, y, sample_weight = _replica_batch(data)
    variables = model.trainable_variables
    guarded = nonfinite_lib.guard_of(optimizer) is not None

    def share_loss(mx, my, msw, global_counts):
        y_pred = _forward(model, mx, training=True)
        share = loss_source.share(mx, my, y_pred, msw)
        if normalizer.is_global and global_counts is None:
            if clock is None:
                global_counts = normalizer.global_counts(share.counts())
            else:  # a collective: its wait is not this replica's compute
                global_counts = clock.excluding(normalizer.global_counts, share.counts())
        denominators = normalizer.denominators(share, global_counts)
        loss, term_losses = normalizer.loss(share, denominators)
        track(share, loss, denominators, term_losses, mx, my, y_pred, msw)
        return optimizer.scale_loss(loss)

    # A non-finite loss makes a gradient NaN: the guard skips the step.
    on_gradients = nonfinite_lib.fold_loss_into_gradients if guarded else None

    can_defer = getattr(optimizer, "accepts_global_divisor", False)
    # Deferred counts are per global example; the losses are divided by this
    # replica's estimate of the global examples (exact with equal shares) so
    # that the backward pass sees the usual magnitudes, and the optimizer
    # multiplies it back before dividing by the true sum.
    estimate = _local_examples(x) * (normalizer.num_shares / accum_steps)
    if accum_steps == 1:
        if clock is None:
            early, deferred = counts_before_forward(model, loss_source, normalizer, x, y,
                                                    sample_weight, can_defer)
        else:  # a collective when the counts are neither constants nor deferred
            early, deferred = clock.excluding(
                lambda data: counts_before_forward(model, loss_source, normalizer, *data,
                                                   can_defer), (x, y, sample_weight))
        if deferred:
            early = early * estimate
        with tf.GradientTape() as tape:
            scaled_loss = share_loss(x, y, sample_weight, early)
        gradients = tape.gradient(scaled_loss, variables)
        if on_gradients is not None:
            gradients = on_gradients(scaled_loss, gradients)
    else:
        if balance is not None:
            raise ValueError("Balanced batches take accum_steps=1 (tfdp.training.option_rules).")
        global_counts, deferred = None, False
        if normalizer.is_global:
            global_counts, deferred = global_micro_batch_counts(
                model, loss_source, normalizer,
                accumulation.split_micro_batches((x, y, sample_weight), accum_steps), accum_steps,
                can_defer,
            )
            if deferred:
                global_counts = global_counts * estimate
        gradients = accumulation.sum_micro_batch_gradients(
            (x, y, sample_weight), accum_steps, variables,
            lambda micro_batch: share_loss(*micro_batch, global_counts), on_gradients,
            unroll=keras_loss_terms.runs_collectives_in_forward(model),
        )
    # Each share's loss is already its part of the global batch's loss (times
    # the global examples N when deferred): the all-reduce SUM inside
    # apply_gradients completes it (and divides by N, summed alongside).
    with contextlib.ExitStack() as stack:
        if deferred:
            stack.enter_context(optimizer.dividing_by_global(_local_examples(x), estimate))
        if balance is not None:  # this replica's seconds ride in the same all-reduce
            stack.enter_context(optimizer.carrying(
                balance.riders(clock, gradients, _local_examples(x)), balance.add_sums))
        optimizer.apply_gradients(zip(gradients, variables))


def replica_eval_step(*, model: keras.Model, loss_source, normalizer: norm_lib.Normalizer,
                      data: Any, track: Track) -> None:
    """One evaluation step on one replica's share of a global batch (inside `strategy.run`)."""
    x, y, sample_weight = _replica_batch(data)
    global_counts, _ = counts_before_forward(model, loss_source, normalizer, x, y, sample_weight)
    y_pred = _forward(model, x, training=False)
    share = loss_source.share(x, y, y_pred, sample_weight)
    if normalizer.is_global and global_counts is None:
        global_counts = normalizer.global_counts(share.counts())
    denominators = normalizer.denominators(share, global_counts)
    loss, term_losses = normalizer.loss(share, denominators)
    track(share, loss, denominators, term_losses, x, y, y_pred, sample_weight)
