"""The loss of a global batch as one device computes it, from shares on replicas and micro-batches.

Keras reduces each replica's loss by the replica's own count and averages
the replicas (`tfdp._upstream.keras_loss_terms` says where and why that is
wrong). tfdp splits every loss into a numerator (a weighted sum of loss
values) and a count (what one device divides by: examples, valid mask
elements, the sum of sample weights), sums the counts over every replica and
micro-batch with one all-reduce of a few float32 scalars per optimizer step,
and divides each replica's numerators by those global counts. The gradient
all-reduce (a SUM) then yields exactly the gradient of the one-device loss
of the global batch, for every reduction, mask and sample weight:

| loss form | per replica and micro-batch | divided by (summed over all) |
|---|---|---|
| `"sum_over_batch_size"`, `"mean"` | sum of weighted values | number of values (valid ones under a mask) |
| `"mean_with_sample_weight"` | sum of weighted values | sum of sample weights (× mask) |
| `"sum"` | sum of weighted values | nothing |
| a function returning one scalar | scalar × examples | examples |
| `add_loss`, regularizers | their sum × examples | examples |

A scalar cannot be un-averaged: it is weighted by the examples it was
computed on, which equals one device when it is a mean over those examples
(and the replicas hold equal numbers of examples), and tfdp warns once. The
additional losses are weighted the same way, so a weight regularizer counts
once per optimizer step and a batch-mean activity regularizer equals one
device.

`"per_replica"` normalisation keeps Keras' semantics instead: each replica
and micro-batch divides by its own count, and their losses are averaged.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfdp._upstream import keras_loss_terms

GLOBAL = "global"
PER_REPLICA = "per_replica"
MODES = (GLOBAL, PER_REPLICA)

_warned_scalar_losses: set[str] = set()


def check_mode(loss_normalization: str) -> str:
    """Returns `loss_normalization` if it is `"global"` or `"per_replica"`, else raises ValueError."""
    if loss_normalization not in MODES:
        raise ValueError(
            f"`loss_normalization` must be 'global' (the loss of the global batch, as one "
            f"device computes it) or 'per_replica' (each replica's mean, averaged, as stock "
            f"Keras). Received: loss_normalization={loss_normalization!r}"
        )
    return loss_normalization


def _loss_label(loss) -> str:
    fn = getattr(loss, "fn", None)
    if fn is not None:
        return getattr(fn, "__qualname__", None) or repr(fn)
    return getattr(loss, "name", None) or type(loss).__name__


def check_loss(loss) -> None:
    """Refuses, up front, loss forms whose one-device result tfdp cannot reproduce.

    Args:
        loss: what is passed as `loss=` (a nest of names, functions, `Loss`
            objects or None).

    Raises:
        ValueError: a `Loss` has `reduction=None` (or `"none"`): Keras then
            differentiates a vector of per-example losses, which has no
            global-batch meaning.
    """
    for leaf in tf.nest.flatten(loss):
        if isinstance(leaf, keras.losses.Loss) and leaf.reduction in (None, "none"):
            raise ValueError(
                f"Loss {leaf.name!r} has reduction={leaf.reduction!r}: it returns one value "
                f"per element, which Keras differentiates as their sum and logs as their "
                f"mean, so no global-batch loss matches it. Use reduction='sum' for the "
                f"sum, or 'sum_over_batch_size' (the default) for the mean."
            )


def _warn_scalar(loss) -> None:
    label = _loss_label(loss)
    if label in _warned_scalar_losses:
        return
    _warned_scalar_losses.add(label)
    warnings.warn(
        f"tfdp: loss {label!r} returns one scalar per batch, which cannot be split "
        f"back into per-example values. tfdp weights it by the examples it was computed "
        f"on, which equals one device when it is a mean over them and every replica "
        f"holds as many examples. Return one value per example (e.g. reduce over all "
        f"but the batch axis) and Keras' reduction averages it exactly.",
        stacklevel=2,
    )


class Share:
    """One replica's (micro-)batch: its losses split into numerators and counts.

    Attributes:
        splits: one `SplitLoss` per loss term.
        weights: each term's loss weight (None: 1).
        metrics: each term's `Mean` for `<output>_loss`, or None.
        additional: float32 scalar, the sum of `model.losses` (0 if none).
        examples: float32 scalar, the examples in this share.
    """

    def __init__(self, splits, weights, metrics, additional, examples):
        self.splits = splits
        self.weights = weights
        self.metrics = metrics
        self.additional = additional
        self.examples = examples

    def counts(self) -> tf.Tensor:
        """float32 [num_terms + 1]: each term's count, then the examples."""
        return tf.stack([tf.cast(s.count, tf.float32) for s in self.splits] + [self.examples])


def _examples(x) -> tf.Tensor:
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.cast(tf.shape(first)[0], tf.float32)


def _additional_losses(model: keras.Model) -> tf.Tensor:
    losses = [tf.reduce_sum(tf.cast(l, tf.float32)) for l in model.losses]
    return tf.add_n(losses) if losses else tf.constant(0.0)


class ModelLoss:
    """The loss a model was compiled with (`loss`, `loss_weights`), split into terms."""

    def __init__(self, model: keras.Model):
        self.model = model

    def share(self, x, y, y_pred, sample_weight, *, counting: bool = False) -> Share:
        """Splits the compiled loss of one (micro-)batch.

        Call after the forward pass, or with `counting=True` (for the counts
        only) on stand-in predictions: then `model.losses`, which belong to
        the last forward pass, are not read.
        """
        terms, y = keras_loss_terms.compiled_terms(self.model, y, y_pred)
        splits = []
        for term in terms:
            split = keras_loss_terms.split_loss(
                term.loss,
                keras_loss_terms.select(term.path, y),
                keras_loss_terms.select(term.path, y_pred),
                keras_loss_terms.select_weight(term.path, sample_weight),
            )
            if split.kind == keras_loss_terms.EXAMPLES:
                _warn_scalar(term.loss)
            splits.append(split)
        additional = tf.constant(0.0) if counting else _additional_losses(self.model)
        return Share(splits, [t.weight for t in terms], [t.metric for t in terms], additional,
                     _examples(x))


class SingleLoss:
    """One Keras loss (name, function or `Loss`) for a single-output model, as `Trainer` takes it."""

    def __init__(self, model: keras.Model, loss):
        if loss is None or (not isinstance(loss, str) and not callable(loss)):
            raise ValueError(f"`loss` must name or be a Keras loss. Received: loss={loss!r}")
        check_loss(loss)
        keras_loss_terms.warn_if_unsupported()  # as tfdp.compile does
        if isinstance(loss, str) and loss.lower() not in ("crossentropy", "ce"):
            keras.losses.get(loss)  # an unknown name fails here, not inside tf.function
        self.model = model
        self.identifier = loss
        self._loss = None

    def resolved(self, y, y_pred) -> keras.losses.Loss:
        if self._loss is None:
            self._loss = keras_loss_terms.resolve_loss(self.identifier, y, y_pred)
        return self._loss

    def share(self, x, y, y_pred, sample_weight, *, counting: bool = False) -> Share:
        """As `ModelLoss.share`."""
        loss = self.resolved(y, y_pred)
        split = keras_loss_terms.split_loss(loss, y, y_pred, sample_weight)
        if split.kind == keras_loss_terms.EXAMPLES:
            _warn_scalar(loss)
        additional = tf.constant(0.0) if counting else _additional_losses(self.model)
        return Share([split], [None], [None], additional, _examples(x))


class Normalizer:
    """Turns shares into the loss each replica differentiates.

    Args:
        mode: `"global"` or `"per_replica"`.
        num_replicas: replicas in sync.
        accum_steps: micro-batches per replica and optimizer step.
    """

    def __init__(self, mode: str, num_replicas: int, accum_steps: int):
        self.mode = check_mode(mode)
        self.num_shares = float(num_replicas * accum_steps)

    @property
    def is_global(self) -> bool:
        return self.mode == GLOBAL

    def global_counts(self, local_counts: tf.Tensor) -> tf.Tensor:
        """Sums per-replica counts over the replicas: one all-reduce, in replica context.

        Args:
            local_counts: float32 [k], this replica's counts (summed over its
                micro-batches).

        Returns:
            float32 [k], the same on every replica.
        """
        local_counts = tf.stop_gradient(local_counts)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return local_counts
        return context.all_reduce(tf.distribute.ReduceOp.SUM, local_counts)

    @staticmethod
    def _per_example(share: Share, allow_sum: bool) -> list[float] | None:
        per = []
        for split in share.splits:
            if split.kind == keras_loss_terms.SUM:
                if not allow_sum:
                    return None
                per.append(1.0)
            elif split.per_example is None:
                return None
            else:
                per.append(split.per_example)
        return per

    def static_global_counts(self, share: Share, examples: int | None) -> tf.Tensor | None:
        """The global counts when they follow from static shapes alone, else None.

        With a static batch dimension every replica and micro-batch holds
        `examples` examples (tf.distribute splits a `drop_remainder` global
        batch evenly), so when each count is the examples times a constant
        known when tracing (a mean with no mask and no
        `"mean_with_sample_weight"` weights, a scalar), the global counts
        are constants and need no all-reduce.

        Args:
            share: a share of one micro-batch (or the replica batch).
            examples: its static number of examples, or None if dynamic.
        """
        if not self.is_global or examples is None:
            return None
        per = self._per_example(share, allow_sum=True)
        if per is None:
            return None
        total = float(examples) * self.num_shares
        return tf.constant([total * p for p in per] + [total], tf.float32)

    def deferred_counts(self, share: Share) -> tf.Tensor | None:
        """Counts per global example, when every count is the examples times a constant, else None.

        Each is the global count divided by the global examples N. The
        caller multiplies them by an estimate of N; the optimizer corrects
        the estimate and divides by the true N, which it sums in the
        gradients' own all-reduce (`NonFiniteGuard.dividing_by_global`). A
        `"sum"` term, which N must not divide, rules it out.
        """
        if not self.is_global:
            return None
        per = self._per_example(share, allow_sum=False)
        return None if per is None else tf.constant(per + [1.0], tf.float32)

    def denominators(self, share: Share, global_counts: tf.Tensor | None) -> tf.Tensor:
        """What divides each numerator of `share`: the global counts, or per replica its own × shares."""
        if self.is_global:
            return global_counts
        return share.counts() * self.num_shares

    def loss(self, share: Share, denominators: tf.Tensor):
        """The scalar this replica differentiates for `share`, and what it reports.

        Args:
            share: one (micro-)batch's `Share`.
            denominators: float32 [num_terms + 1] from `denominators`.

        Returns:
            `(loss, term_losses)`: float32 scalar, this share's part of the
            global batch's loss (summed over replicas and micro-batches it is
            the one-device loss), and each term's unweighted part.
        """
        total = tf.constant(0.0)
        term_losses = []
        for index, (split, weight) in enumerate(zip(share.splits, share.weights)):
            if split.kind == keras_loss_terms.SUM:
                part = split.numerator
            else:
                part = tf.math.divide_no_nan(split.numerator, denominators[index])
            term_losses.append(part)
            total += part if weight is None else part * tf.cast(weight, tf.float32)
        examples = denominators[-1]
        total += tf.math.divide_no_nan(share.additional * share.examples, examples)
        return total, term_losses

    def report(self, tracker, share: Share, loss: tf.Tensor, denominators: tf.Tensor,
               term_losses: Sequence[tf.Tensor] = ()) -> None:
        """Adds this share to the logged loss means, so they equal one device's.

        A `Mean` tracker, summed over replicas, gets `loss × N` with weight
        `n` from a share of `n` of the global batch's `N` examples: over a
        step, the global loss weighted by the global examples, as Keras logs
        on one device.
        """
        scale = tf.math.divide_no_nan(denominators[-1], share.examples)
        tracker.update_state(loss * scale, sample_weight=share.examples)
        for metric, part in zip(share.metrics, term_losses):
            if metric is not None:
                metric.update_state(part * scale, sample_weight=share.examples)


def sum_counts(shares_counts: Callable[[Any], tf.Tensor], micro_batches: Any,
               accum_steps: int, size: int) -> tf.Tensor:
    """Sums `shares_counts(micro_batch)` over `accum_steps` micro-batches (a `tf.while_loop`).

    Args:
        shares_counts: maps one micro-batch to float32 [size] counts.
        micro_batches: a nest of tensors [accum_steps, micro, ...].
        accum_steps: micro-batches.
        size: the length of the counts.
    """

    def body(index, total):
        micro_batch = tf.nest.map_structure(
            lambda t: None if t is None else t[index], micro_batches
        )
        return index + 1, total + shares_counts(micro_batch)

    _, total = tf.while_loop(
        lambda index, _: index < accum_steps, body,
        (tf.constant(0), tf.zeros([size], tf.float32)),
    )
    return total
