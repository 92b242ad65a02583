"""Keras' loss reductions split into a numerator and a count, and the compiled loss's terms.

Why tfdp needs this: Keras 3 (`keras/src/losses/loss.py`, `reduce_values`,
Keras 3.15) reduces each replica's loss with that replica's own count (its
examples, its valid mask elements, its sample-weight sum) and then divides
by the number of replicas (`scale_loss_for_distribution`). That averages
per-replica means: wrong when the replicas hold different counts (masks,
weights, the last batch), and a loss function that returns one scalar is
returned unscaled, so the gradient all-reduce multiplies the learning rate
by the replica count. Keras has no public way to get the numerator and the
count apart, so `split_loss` repeats what `Loss.__call__` and
`reduce_weighted_values` do, returning `numerator / count` instead of the
quotient: on one device, `numerator / count` is exactly what the loss
returns. `tfdp.training.loss_normalization` then divides by the count
summed over every replica and micro-batch.

Private Keras members touched (Keras 3.15):
- `keras.src.losses.loss.squeeze_or_expand_to_same_rank`;
- `keras.src.backend.get_keras_mask` (the mask a `Masking` or
  `Embedding(mask_zero=True)` layer leaves on the predictions);
- `keras.src.trainers.compile_utils.get_loss` (what `compile` makes of a
  loss identifier, the `"crossentropy"` alias included);
- `Model._compile_loss` (`built`, `build`, `_flat_losses`, `metrics`,
  `output_names`) and `Model._loss_tracker`, `Model._call_has_training_arg`.

`tests/_upstream/test_keras_loss_terms.py` checks `numerator / count`
against Keras' own loss for every reduction, with and without sample
weights and masks, and the compiled terms against `model.compute_loss`, so
a Keras change that breaks this copy fails there first.
"""

from __future__ import annotations

import collections
import warnings

import keras
import tensorflow as tf
from keras.src import backend as _keras_backend
from keras.src import tree as _keras_tree
from keras.src.losses import loss as _keras_loss
from keras.src.trainers import compile_utils as _keras_compile_utils

from tfdp._upstream import _versions

# pylint: disable=protected-access

SUM = "sum"  # divided by nothing
COUNT = "count"  # divided by a count of elements or of sample weight
EXAMPLES = "examples"  # a scalar: weighted by the examples it was computed on

SplitLoss = collections.namedtuple("SplitLoss", ["numerator", "count", "kind", "per_example"],
                                   defaults=[None])
SplitLoss.__doc__ = """One loss on one (micro-)batch, as a numerator and what divides it.

Attributes:
    numerator: float32 scalar; the weighted sum of the loss values (for
        kind `EXAMPLES`, the scalar times the examples).
    count: float32 scalar; what one device divides the numerator by (1 for
        kind `SUM`).
    kind: `SUM`, `COUNT` or `EXAMPLES`.
    per_example: a Python float when the count is the examples times a
        number known when tracing (the values per example, for a mean with
        no mask; 1 for `EXAMPLES`), else None.
"""

LossTerm = collections.namedtuple("LossTerm", ["path", "loss", "weight", "metric"])
LossTerm.__doc__ = """One loss of a compiled model.

Attributes:
    path: where its target and prediction sit in `y` and `y_pred` (a tuple
        of keys), or None for a single output.
    loss: a `keras.losses.Loss`.
    weight: its `loss_weights` entry, or None.
    metric: the `Mean` Keras logs it under (`<output>_loss`), or None.
"""


#: Keras (major, minor) versions these members were read from, inclusive.
KNOWN_KERAS_RANGE = ((3, 10), (3, 15))

_warned_version = False


def is_supported(keras_version: str | None = None) -> bool:
    """Whether `keras_version` (default: the installed one) is in `KNOWN_KERAS_RANGE`."""
    return _versions.keras_in_range(KNOWN_KERAS_RANGE, keras_version)


def warn_if_unsupported() -> None:
    """Warns once when this Keras is outside `KNOWN_KERAS_RANGE`: the copy may no longer match."""
    global _warned_version  # pylint: disable=global-statement
    if _warned_version or is_supported():
        return
    _warned_version = True
    low, high = KNOWN_KERAS_RANGE
    warnings.warn(
        f"tfdp's loss normalisation repeats Keras' loss reduction as Keras "
        f"{low[0]}.{low[1]} to {high[0]}.{high[1]} wrote it (Keras divides each "
        f"replica's loss by that replica's own count, keras/src/losses/loss.py "
        f"`reduce_values`, and has no public way to get the two apart); Keras "
        f"{keras.__version__} may reduce differently, and the loss would then differ "
        f"from one device's. Run tests/_upstream/test_keras_loss_terms.py against this "
        f"Keras, or install keras<={high[0]}.{high[1]}.",
        RuntimeWarning,
        stacklevel=3,
    )


def reduction_of(loss: keras.losses.Loss) -> str | None:
    """The loss's reduction (`None` and `"none"` mean none)."""
    return loss.reduction


def _count(values) -> tf.Tensor:
    return tf.cast(tf.size(values), tf.float32)


def split_loss(loss: keras.losses.Loss, y_true, y_pred, sample_weight=None) -> SplitLoss:
    """Splits `loss(y_true, y_pred, sample_weight)` into a numerator and a count.

    Mirrors `Loss.__call__` (Keras 3.15): the prediction's Keras mask and
    one the loss sets on its values are combined and merged into the sample
    weight; the weighted values are summed. The count is what
    `reduce_values` divides by: the number of values for
    `"sum_over_batch_size"` and `"mean"` (the valid ones, scaled as
    `apply_mask` scales them, under a mask), the sum of the weights for
    `"mean_with_sample_weight"`, nothing for `"sum"`.

    A loss whose values are one scalar (a function that reduces by itself)
    and that no weight or mask spreads out is of kind `EXAMPLES`: its
    numerator is the scalar times the examples in `y_pred` and its count
    those examples, so averaging over a global batch weights each replica by
    its examples.

    Args:
        loss: a `keras.losses.Loss` whose reduction is not None.
        y_true, y_pred: one output's targets and predictions, [batch, ...].
        sample_weight: None or weights broadcastable as Keras broadcasts them.

    Returns:
        A `SplitLoss`; on one device `numerator / count` equals
        `loss(y_true, y_pred, sample_weight)` (0 where the count is 0).
    """
    in_mask = _keras_backend.get_keras_mask(y_pred)
    dtype = loss.dtype
    y_pred = _keras_tree.map_structure(lambda t: keras.ops.convert_to_tensor(t, dtype=dtype), y_pred)
    y_true = _keras_tree.map_structure(lambda t: keras.ops.convert_to_tensor(t, dtype=dtype), y_true)
    values = loss.call(y_true, y_pred)
    out_mask = _keras_backend.get_keras_mask(values)
    values = keras.ops.convert_to_tensor(values, dtype=dtype)
    masks = [m for m in (in_mask, out_mask) if m is not None]
    mask = None
    if masks:
        mask = masks[0] if len(masks) == 1 else tf.logical_and(
            tf.cast(masks[0], tf.bool), tf.cast(masks[1], tf.bool)
        )

    weight = None if sample_weight is None else tf.cast(sample_weight, values.dtype)
    if mask is not None:
        float_mask = tf.cast(mask, values.dtype)
        if weight is not None:
            float_mask, weight = _keras_loss.squeeze_or_expand_to_same_rank(float_mask, weight)
            weight = weight * float_mask
        else:
            weight = float_mask
    if weight is not None:
        values, weight = _keras_loss.squeeze_or_expand_to_same_rank(values, weight)
        values = values * weight

    reduction = loss.reduction
    if values.shape.rank == 0:
        examples = tf.cast(tf.shape(tf.nest.flatten(y_pred)[0])[0], tf.float32)
        return SplitLoss(tf.cast(values, tf.float32) * examples, examples, EXAMPLES, 1.0)
    numerator = tf.reduce_sum(tf.cast(values, tf.float32))
    if reduction == "sum":
        return SplitLoss(numerator, tf.constant(1.0), SUM)
    if reduction == "mean_with_sample_weight" and weight is not None:
        return SplitLoss(numerator, tf.reduce_sum(tf.cast(weight, tf.float32)), COUNT)
    count = _count(values)
    per_example = None
    if mask is None and values.shape.rank and values.shape[1:].is_fully_defined():
        per_example = float(values.shape[1:].num_elements())
    if mask is not None:
        # apply_mask weighs the valid entries by total / valid, then the mean
        # divides by the number of values: numerator / (valid · values / total).
        total = _count(mask)
        valid = tf.reduce_sum(tf.cast(mask, tf.float32))
        count = tf.math.divide_no_nan(valid * count, total)
    return SplitLoss(numerator, count, COUNT, per_example)


def resolve_loss(identifier, y_true, y_pred) -> keras.losses.Loss:
    """The `keras.losses.Loss` that `compile(loss=identifier)` uses for this output."""
    return _keras_compile_utils.get_loss(identifier, y_true, y_pred)


def _targets_like_predictions(compile_loss, y_true, y_pred):
    """`y_true` in the structure of `y_pred`, for the common cases `CompileLoss.call` accepts."""
    if not _keras_tree.is_nested(y_true) and not _keras_tree.is_nested(y_pred):
        return y_true
    try:
        _keras_tree.assert_same_structure(y_pred, y_true)
        return y_true
    except ValueError:
        pass
    if not _keras_tree.is_nested(y_true) and hasattr(y_pred, "__len__") and len(y_pred) == 1:
        y_true = [y_true]
    elif isinstance(y_pred, (list, tuple)) and isinstance(y_true, dict):
        names = list(compile_loss.output_names or ())
        if set(names) == set(y_true):
            y_true = [y_true[name] for name in names]
    flat = _keras_tree.flatten(y_true)
    if len(flat) != len(_keras_tree.flatten(y_pred)):
        raise ValueError(
            "tfdp: y and the model's outputs have different structures "
            f"({len(flat)} targets, {len(_keras_tree.flatten(y_pred))} outputs). "
            "Give one target per output, in a list or a dict keyed by output name."
        )
    return _keras_tree.pack_sequence_as(y_pred, flat)


def compiled_terms(model: keras.Model, y_true, y_pred):
    """The compiled model's loss terms and `y_true` arranged like `y_pred`.

    Args:
        model: a model compiled with a loss.
        y_true, y_pred: targets and predictions of one batch.

    Returns:
        `(terms, y_true)`: a list of `LossTerm` and the targets in the
        predictions' structure, ready for `select`.
    """
    compile_loss = model._compile_loss
    if compile_loss is None:
        return [], y_true
    y_true = _targets_like_predictions(compile_loss, y_true, y_pred)
    if not compile_loss.built:
        compile_loss.build(y_true, y_pred)
    metrics = list(compile_loss.metrics) if len(compile_loss.metrics) else []
    terms = []
    for index, (path, loss, weight, _) in enumerate(compile_loss._flat_losses):
        metric = metrics[index] if index < len(metrics) else None
        terms.append(LossTerm(tuple(path) if path else None, loss, weight, metric))
    return terms, y_true


def select(path, structure):
    """The leaf of `structure` at `path` (a tuple of keys; None: the structure)."""
    if path is None:
        return structure
    for key in path:
        structure = structure[key]
    return structure


def select_weight(path, sample_weight):
    """The sample weight for the output at `path`, as `CompileLoss.call` picks it."""
    if sample_weight is not None and _keras_tree.is_nested(sample_weight) and path is not None:
        return select(path, sample_weight)
    return sample_weight


def loss_tracker(model: keras.Model):
    """The `Mean` Keras logs as `loss`."""
    return model._loss_tracker


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether `model.call` takes `training` (Keras then passes it)."""
    return model._call_has_training_arg


def runs_collectives_in_forward(model: keras.Model) -> bool:
    """Whether a layer of `model` all-reduces in its forward pass under a strategy.

    Keras' `BatchNormalization(synchronized=True)` does (its batch moments
    over all replicas); under MirroredStrategy that all-reduce is a
    `merge_call`, which cannot run inside a `tf.while_loop`.
    """
    return any(isinstance(layer, keras.layers.BatchNormalization)
               and getattr(layer, "synchronized", False)
               for layer in model._flatten_layers(include_self=True, recursive=True))


def may_produce_mask(model: keras.Model) -> bool:
    """Whether the model's predictions may carry a Keras mask (then counts need the forward pass).

    True when a layer creates masks: a `Masking` layer, an `Embedding` with
    `mask_zero=True`, or a layer from outside Keras that defines
    `compute_mask`. Keras' own layers that only pass masks on do not count.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, keras.layers.Masking):
            return True
        if isinstance(layer, keras.layers.Embedding):
            if getattr(layer, "mask_zero", False):
                return True
            continue
        compute_mask = type(layer).compute_mask
        if (compute_mask is not keras.layers.Layer.compute_mask
                and not type(layer).__module__.startswith("keras.")):
            return True
    return False
