"""`mlp`: a multilayer perceptron over flattened features.

This module owns the MLP builder: it flattens an input of any shape (8x8
images, feature vectors, ...) and applies ReLU hidden layers, optional
dropout, and the float32 logits head. It is the baseline every dataset can
train.
"""

from __future__ import annotations

from typing import Sequence

import keras

from tfdp.models import common
from tfdp.models import registry
from tfdp.models import requirements

NAME = "mlp"


@registry.register(NAME, inputs=requirements.IMAGES_OR_FEATURES)
def mlp(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    hidden_units: Sequence[int] = (128, 64),
    dropout: float = 0.0,
) -> keras.Model:
    """Builds an MLP classifier.

    Args:
        input_shape: one example's shape, without the batch axis; any rank
            (it is flattened), e.g. `(8, 8, 1)` or `(64,)`.
        num_classes: logit width (>= 2).
        hidden_units: the width of each ReLU hidden layer, first to last; may
            be empty (a linear classifier). Defaults to `(128, 64)`.
        dropout: dropout rate after each hidden layer, in [0, 1). Defaults to
            0.

    Returns:
        A `keras.Model` from float32 inputs `(batch, *input_shape)` to float32
        logits `(batch, num_classes)`.

    Raises:
        ValueError: an argument is invalid (the message says which and why).
    """
    input_shape = common.check_input_shape(NAME, input_shape)
    num_classes = common.check_num_classes(NAME, num_classes)
    hidden_units = common.check_positive_ints(NAME, "hidden_units", hidden_units,
                                              allow_empty=True)
    dropout = common.check_rate(NAME, "dropout", dropout)

    inputs = keras.Input(input_shape, name="features")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for i, units in enumerate(hidden_units):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, name=f"dropout_{i}")(x)
    return keras.Model(inputs, common.logits(x, num_classes), name=NAME)
