"""The loss forms Keras users write, each with a tiny model and data that split unevenly over 2 replicas.

Shared by `test_loss_normalization.py` (2 logical CPU replicas) and
`loss_forms_multiworker_job.py` (2 worker processes). Every global batch of
`GLOBAL_BATCH` examples puts very different numbers of valid elements and
weight on its two halves (the two replicas) and on their quarters (the
micro-batches with `accum_steps=2`), so averaging per-replica means cannot
pass for the global mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 16
STEPS = 3
NUM_EXAMPLES = GLOBAL_BATCH * STEPS
FEATURES, TIMESTEPS, CLASSES, VOCAB = 4, 6, 3, 9
LEARNING_RATE = 0.2


def _rng():
    return np.random.default_rng(7)


def _uneven_lengths() -> np.ndarray:
    """Valid timesteps per example: the first half of each batch holds far fewer than the second."""
    lengths = np.empty(NUM_EXAMPLES, np.int64)
    for i in range(NUM_EXAMPLES):
        position = i % GLOBAL_BATCH
        lengths[i] = 1 + position % 2 if position < GLOBAL_BATCH // 2 else TIMESTEPS - position % 3
    return lengths


def _uneven_weights() -> np.ndarray:
    position = np.arange(NUM_EXAMPLES) % GLOBAL_BATCH
    return np.where(position < GLOBAL_BATCH // 2, 0.1 + 0.05 * position, 2.0 + 0.5 * (position % 4)).astype(
        "float32"
    )


def dense_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1),
    ])


def classifier():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(5, activation="tanh"),
        keras.layers.Dense(CLASSES),
    ])


def regularized_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(5, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05),
                                activity_regularizer=keras.regularizers.L2(0.01))(inputs)
    hidden = _MeanPenalty()(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


class _MeanPenalty(keras.layers.Layer):
    """`add_loss` of a batch mean: a data-dependent additional loss."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def masked_sequence_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((TIMESTEPS, FEATURES)), keras.layers.Masking(0.0),
        keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1),
    ])


def embedding_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((TIMESTEPS,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 4, mask_zero=True),
        keras.layers.Dense(CLASSES),
    ])


def two_output_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return keras.Model(inputs, {
        "value": keras.layers.Dense(1, name="value")(hidden),
        "label": keras.layers.Dense(CLASSES, name="label")(hidden),
    })


def dense_data():
    rng = _rng()
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = (x[:, :1] * 2.0 + rng.normal(size=(NUM_EXAMPLES, 1))).astype("float32")
    return x, y


def class_data():
    x, _ = dense_data()
    y = (np.abs(x[:, 0] * 2).astype(np.int64) % CLASSES).astype("int32")
    return x, y


def masked_sequence_data():
    rng = _rng()
    x = rng.normal(size=(NUM_EXAMPLES, TIMESTEPS, FEATURES)).astype("float32") + 0.5
    y = rng.normal(size=(NUM_EXAMPLES, TIMESTEPS, 1)).astype("float32")
    for i, length in enumerate(_uneven_lengths()):
        x[i, length:] = 0.0
    return x, y


def token_data():
    rng = _rng()
    tokens = rng.integers(1, VOCAB, size=(NUM_EXAMPLES, TIMESTEPS)).astype("int32")
    labels = rng.integers(0, CLASSES, size=(NUM_EXAMPLES, TIMESTEPS)).astype("int32")
    for i, length in enumerate(_uneven_lengths()):
        tokens[i, length:] = 0
    return tokens, labels


def padding_weights():
    """A [batch, timesteps] 0/1 weight: the mask handed to the loss as `sample_weight`."""
    return (np.arange(TIMESTEPS)[None, :] < _uneven_lengths()[:, None]).astype("float32")


def scalar_mse(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_true - y_pred))


def per_example_mse(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


@dataclasses.dataclass(frozen=True)
class LossForm:
    """One way of writing a loss.

    Attributes:
        name: the test id.
        model: builds the model (call inside a strategy scope).
        data: `() -> (x, y)` arrays of `NUM_EXAMPLES`.
        loss: `() -> loss` as passed to compile / Trainer.
        sample_weight: `() -> array` or None.
        class_weight: a dict or None (fit only).
        compile_kwargs: more `compile` arguments (`loss_weights`).
        trainer: whether `tfdp.Trainer` offers it (one loss, one output).
    """

    name: str
    model: Callable[[], keras.Model]
    data: Callable[[], tuple]
    loss: Callable[[], Any]
    sample_weight: Callable[[], np.ndarray] | None = None
    class_weight: dict | None = None
    compile_kwargs: dict = dataclasses.field(default_factory=dict)
    trainer: bool = True

    def dataset(self) -> tf.data.Dataset:
        x, y = self.data()
        parts = (x, y) if self.sample_weight is None else (x, y, self.sample_weight())
        return tf.data.Dataset.from_tensor_slices(parts).batch(GLOBAL_BATCH, drop_remainder=True)

    def fit_kwargs(self) -> dict:
        return {} if self.class_weight is None else {"class_weight": self.class_weight}


FORMS = [
    LossForm("mse_object", dense_model, dense_data, keras.losses.MeanSquaredError),
    LossForm("per_example_function", dense_model, dense_data, lambda: per_example_mse),
    LossForm("scalar_function", dense_model, dense_data, lambda: scalar_mse),
    LossForm("reduction_sum", dense_model, dense_data,
             lambda: keras.losses.MeanSquaredError(reduction="sum")),
    LossForm("sample_weight", dense_model, dense_data, keras.losses.MeanSquaredError,
             sample_weight=_uneven_weights),
    LossForm("mean_with_sample_weight", dense_model, dense_data,
             lambda: keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
             sample_weight=_uneven_weights),
    LossForm("class_weight", classifier, class_data,
             lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
             class_weight={0: 0.2, 1: 1.0, 2: 3.0}, trainer=False),
    LossForm("regularizers_add_loss", regularized_model, dense_data, keras.losses.MeanSquaredError),
    LossForm("masking_layer", masked_sequence_model, masked_sequence_data,
             keras.losses.MeanSquaredError),
    LossForm("embedding_mask_zero", embedding_model, token_data,
             lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
    LossForm("mask_as_sample_weight", masked_sequence_model, masked_sequence_data,
             lambda: keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
             sample_weight=padding_weights),
    LossForm("two_outputs_loss_weights", two_output_model,
             lambda: (dense_data()[0], {"value": dense_data()[1], "label": class_data()[1]}),
             lambda: {"value": keras.losses.MeanSquaredError(),
                      "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
             compile_kwargs={"loss_weights": {"value": 0.5, "label": 2.0}}, trainer=False),
]
FORMS_BY_NAME = {form.name: form for form in FORMS}

#: The subset run on 2 worker processes (`multiworker_training_job.py`).
MULTIWORKER_CELLS = (
    ("scalar_function", "fit"),
    ("masking_layer", "fit"),
    ("masking_layer", "fit_accum2"),
    ("mean_with_sample_weight", "fit_accum2"),
    ("two_outputs_loss_weights", "fit"),
    ("embedding_mask_zero", "trainer_accum2"),
)


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.trainable_weights]


def keras_one_device(form: LossForm):
    """Plain `model.compile` + `fit` on one device: `(initial weights, final weights, loss history)`."""
    model = form.model()
    initial = weights(model)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss(),
                  **form.compile_kwargs)
    history = model.fit(form.dataset(), epochs=1, verbose=0, **form.fit_kwargs())
    return initial, weights(model), history.history


def relative_deviation(initial, reference, other) -> float:
    """‖other − reference‖ / ‖reference − initial‖ over all weights: the error relative to the update."""
    diff = np.sqrt(sum(float(np.sum((o - r) ** 2)) for o, r in zip(other, reference)))
    update = np.sqrt(sum(float(np.sum((r - i) ** 2)) for r, i in zip(reference, initial)))
    return diff / update
