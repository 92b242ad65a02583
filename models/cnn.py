"""`cnn`: a small convolutional network for small grey images.

This module owns the CNN builder, sized for 8x8 digits and 28x28 MNIST and
fast on two CPU cores: 3x3 convolutions with `same` padding, one 2x2 max
pool, flatten, a ReLU dense layer with dropout, and the float32 logits head.
It reaches about 0.97 test accuracy on `digits` in 10 epochs (README's main
command). Larger images want `resnet20` or `resnet50`.
"""

from __future__ import annotations

from typing import Sequence

import keras

from tfdp.models import common
from tfdp.models import registry
from tfdp.models import requirements

NAME = "cnn"


@registry.register(NAME, inputs=requirements.InputRequirements(kinds=("images",),
                                                                min_image_size=2))
def cnn(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    filters: Sequence[int] = (32, 64),
    dense_units: int = 128,
    dropout: float = 0.25,
) -> keras.Model:
    """Builds the small CNN classifier.

    Layers: one `Conv2D(f, 3x3, padding="same", relu)` per entry of
    `filters`, `MaxPooling2D(2x2)`, `Flatten`, `Dropout(dropout)`,
    `Dense(dense_units, relu)`, `Dropout(dropout)`, `Dense(num_classes)`
    in float32.

    Args:
        input_shape: `(height, width, channels)`, each size >= 2, e.g.
            `(8, 8, 1)` for `digits` or `(28, 28, 1)` for MNIST. Pixels are
            expected as floats scaled to [0, 1].
        num_classes: logit width (>= 2).
        filters: output channels of each 3x3 convolution, in order. Defaults
            to `(32, 64)`.
        dense_units: width of the hidden dense layer. Defaults to 128.
        dropout: dropout rate before and after the hidden dense layer, in
            [0, 1). Defaults to 0.25.

    Returns:
        A `keras.Model` from float32 images `(batch, height, width,
        channels)` to float32 logits `(batch, num_classes)`.

    Raises:
        ValueError: `input_shape` is not `(height, width, channels)` with
            height and width >= 2, or another argument is invalid.
    """
    input_shape = common.check_input_shape(
        NAME, input_shape, rank=3, expected="(height, width, channels)",
        hint="Add a channel axis to grey 2-D images (e.g. (8, 8) -> (8, 8, 1)), or "
             "use model 'mlp' for flat feature vectors.",
    )
    if min(input_shape[:2]) < 2:
        raise ValueError(
            f"`input_shape` of model {NAME!r} must have height and width >= 2 (it "
            f"max-pools 2x2). Received: input_shape={input_shape!r}. Use model 'mlp' "
            f"for such inputs."
        )
    num_classes = common.check_num_classes(NAME, num_classes)
    filters = common.check_positive_ints(NAME, "filters", filters)
    dense_units = common.check_positive_int(NAME, "dense_units", dense_units)
    dropout = common.check_rate(NAME, "dropout", dropout)

    inputs = keras.Input(input_shape, name="images")
    x = inputs
    for i, width in enumerate(filters):
        x = keras.layers.Conv2D(width, 3, padding="same", activation="relu", name=f"conv_{i}")(x)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout_0")(x)
    x = keras.layers.Dense(dense_units, activation="relu", name="dense")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout_1")(x)
    return keras.Model(inputs, common.logits(x, num_classes), name=NAME)
