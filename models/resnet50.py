"""`resnet50`: Keras' ImageNet ResNet-50, randomly initialised.

This module owns the `resnet50` builder: `keras.applications.ResNet50` with
`weights=None` (nothing is downloaded), without its top, average-pooled, and
the float32 logits head in place of Keras' softmax classifier (whose dtype
would follow the mixed precision policy). The bottleneck architecture is
Keras'; this module only checks the input size, attaches the head, and
switches on synchronized batch normalisation or per-block recomputation of
Keras' 16 bottleneck blocks (`conv2_block1` ... `conv5_block3`).
"""

from __future__ import annotations

from typing import Sequence

import keras

from tfdp.models import common
from tfdp.models import registry
from tfdp.models import requirements
from tfdp.models import remat as remat_lib

NAME = "resnet50"
#: Smallest height and width keras.applications.ResNet50 accepts (5 stride-2 stages).
MIN_SIZE = 32


@registry.register(NAME, inputs=requirements.InputRequirements(kinds=("images",),
                                                                min_image_size=MIN_SIZE))
def resnet50(*, input_shape: Sequence[int], num_classes: int, remat: bool = False,
             sync_bn: bool = False) -> keras.Model:
    """Builds ResNet-50 (He et al., 2016) with random weights.

    Args:
        input_shape: `(height, width, channels)` with height and width >=
            32, e.g. `(224, 224, 3)` for ImageNet. Pixels are expected as
            floats (scaled or standardised by the input pipeline).
        num_classes: logit width (>= 2).
        remat: recompute each bottleneck block's activations in the backward
            pass instead of keeping them (`tfdp.models.remat`): less memory
            for about one more forward pass per step; same gradients.
            Defaults to False.
        sync_bn: batch normalisation statistics over the global batch
            (`BatchNormalization(synchronized=True)`) instead of each
            replica's share. Defaults to False.

    Returns:
        A `keras.Model` (about 23.5M parameters plus 2049 x `num_classes`)
        from float32 images to float32 logits `(batch, num_classes)`.

    Raises:
        ValueError: `input_shape` is not `(height, width, channels)` with
            height and width >= 32, or `num_classes` is invalid.
    """
    input_shape = common.check_input_shape(
        NAME, input_shape, rank=3, expected="(height, width, channels)",
        hint="Add a channel axis to grey 2-D images.",
    )
    if min(input_shape[:2]) < MIN_SIZE:
        raise ValueError(
            f"`input_shape` of model {NAME!r} must have height and width >= "
            f"{MIN_SIZE} (ResNet-50 downsamples 32x). Received: "
            f"input_shape={input_shape!r}. Resize the images in the input pipeline "
            f"(e.g. tf.image.resize to 32x32 or more), or use model 'resnet20' or "
            f"'cnn' for small images."
        )
    num_classes = common.check_num_classes(NAME, num_classes)
    common.check_bool(NAME, "remat", remat)
    common.check_bool(NAME, "sync_bn", sync_bn)

    inputs = keras.Input(input_shape, name="images")
    backbone = keras.applications.ResNet50(
        include_top=False, weights=None, input_shape=input_shape, pooling="avg"
    )
    if sync_bn:  # Read at call time; also what the layers' configs say.
        for layer in backbone.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = True
    if remat:
        ends = [f"conv{stage}_block{block}_out"
                for stage, blocks in ((2, 3), (3, 4), (4, 6), (5, 3))
                for block in range(1, blocks + 1)]
        backbone = remat_lib.rematerialize_blocks(backbone, start="pool1_pool", ends=ends)
    x = backbone(inputs)
    return keras.Model(inputs, common.logits(x, num_classes), name=NAME)
