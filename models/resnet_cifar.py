"""`resnet20`, `resnet32`, `resnet56`: the CIFAR ResNets of He et al. (2016).

This module owns the CIFAR-style ResNet v1 ("Deep Residual Learning for Image
Recognition", Section 4.2): a 3x3 convolution with 16 filters, then three
stages of `n` basic blocks with 16, 32 and 64 filters (the first block of
stages 2 and 3 halves height and width with stride 2), global average
pooling and the float32 logits head; depth = 6n + 2. Every convolution is
followed by batch normalisation; a basic block is conv-BN-ReLU-conv-BN, plus
the shortcut, then ReLU. Where a block changes shape, the shortcut is a 1x1
strided convolution with batch normalisation (the paper's option B; its
CIFAR experiments used option A, zero-padding, which has 0.003M fewer
parameters). Parameters: 0.27M (resnet20), 0.47M (resnet32), 0.86M
(resnet56) for 10 classes.

ImageNet's bottleneck ResNet-50 is `tfdp.models.resnet50`.
"""

from __future__ import annotations

from typing import Sequence

import keras

from tfdp.models import common
from tfdp.models import registry
from tfdp.models import requirements
from tfdp.models import remat as remat_lib

#: Filters of the three stages.
STAGE_FILTERS = (16, 32, 64)
#: The registered depths.
DEPTHS = (20, 32, 56)


def _conv_bn(x, filters: int, *, strides: int, kernel_size: int, momentum: float, name: str,
             sync_bn: bool):
    x = keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False,
        kernel_initializer="he_normal", name=f"{name}_conv",
    )(x)
    return keras.layers.BatchNormalization(momentum=momentum, epsilon=1e-5, synchronized=sync_bn,
                                           name=f"{name}_bn")(x)


def _basic_block(x, filters: int, *, strides: int, momentum: float, name: str, sync_bn: bool):
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, strides=strides, kernel_size=1, momentum=momentum,
                            name=f"{name}_shortcut", sync_bn=sync_bn)
    y = _conv_bn(x, filters, strides=strides, kernel_size=3, momentum=momentum, name=f"{name}_1",
                 sync_bn=sync_bn)
    y = keras.layers.ReLU(name=f"{name}_1_relu")(y)
    y = _conv_bn(y, filters, strides=1, kernel_size=3, momentum=momentum, name=f"{name}_2",
                 sync_bn=sync_bn)
    y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def check_depth(depth) -> int:
    """Validates a CIFAR ResNet depth and returns `n`, the blocks per stage.

    Raises:
        ValueError: `depth` is not an integer 6n + 2 with n >= 1.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(
            "`depth` of a CIFAR ResNet must be 6n + 2 for an integer n >= 1 (three "
            "stages of n two-layer blocks plus the first convolution and the "
            "classifier): 8, 14, 20, 32, 44, 56, 110, ... "
            f"Received: depth={depth!r}"
        )
    return (depth - 2) // 6


def resnet_cifar(
    *,
    depth: int,
    input_shape: Sequence[int],
    num_classes: int,
    batch_norm_momentum: float = 0.9,
    remat: bool = False,
    sync_bn: bool = False,
) -> keras.Model:
    """Builds a CIFAR ResNet v1 of any depth 6n + 2.

    Args:
        depth: layers with weights: 6n + 2, e.g. 20, 32, 56, 110.
        input_shape: `(height, width, channels)`, e.g. `(32, 32, 3)` for
            CIFAR-10 (any size works: the three stages divide height and
            width by 4 in all, rounding up). Pixels are expected as floats
            (scaled to [0, 1] or standardised).
        num_classes: logit width (>= 2).
        batch_norm_momentum: momentum of the moving mean/variance of every
            batch normalisation, in [0, 1). Defaults to 0.9.
        remat: recompute each residual block's activations in the backward
            pass instead of keeping them (`tfdp.models.remat`): less memory
            for about one more forward pass per step; same gradients.
            Defaults to False.
        sync_bn: batch normalisation statistics over the global batch
            (`BatchNormalization(synchronized=True)`: one all-reduce per layer
            per micro-batch under `tf.distribute`), instead of each replica's
            share. Defaults to False.

    Returns:
        A `keras.Model` named `resnet{depth}` from float32 images to float32
        logits `(batch, num_classes)`.

    Raises:
        ValueError: `depth` is not 6n + 2, `input_shape` is not `(height,
            width, channels)`, or another argument is invalid.
    """
    name = f"resnet{depth}"
    blocks = check_depth(depth)
    input_shape = common.check_input_shape(
        name, input_shape, rank=3, expected="(height, width, channels)",
        hint="Add a channel axis to grey 2-D images (e.g. (28, 28) -> (28, 28, 1)).",
    )
    num_classes = common.check_num_classes(name, num_classes)
    momentum = common.check_rate(name, "batch_norm_momentum", batch_norm_momentum)
    common.check_bool(name, "remat", remat)
    common.check_bool(name, "sync_bn", sync_bn)

    inputs = keras.Input(input_shape, name="images")
    x = _conv_bn(inputs, STAGE_FILTERS[0], strides=1, kernel_size=3, momentum=momentum,
                 name="stem", sync_bn=sync_bn)
    x = keras.layers.ReLU(name="stem_relu")(x)
    ends = []
    for stage, filters in enumerate(STAGE_FILTERS):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            block_name = f"stage{stage + 1}_block{block + 1}"
            x = _basic_block(x, filters, strides=strides, momentum=momentum, name=block_name,
                             sync_bn=sync_bn)
            ends.append(f"{block_name}_out")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    model = keras.Model(inputs, common.logits(x, num_classes), name=name)
    if remat:
        model = remat_lib.rematerialize_blocks(model, start="stem_relu", ends=ends)
    return model


def _register(depth: int) -> None:
    def build(*, input_shape: Sequence[int], num_classes: int,
              batch_norm_momentum: float = 0.9, remat: bool = False,
              sync_bn: bool = False) -> keras.Model:
        return resnet_cifar(depth=depth, input_shape=input_shape, num_classes=num_classes,
                            batch_norm_momentum=batch_norm_momentum, remat=remat,
                            sync_bn=sync_bn)

    build.__name__ = build.__qualname__ = f"resnet{depth}"
    build.__doc__ = (
        f"Builds ResNet-{depth} for CIFAR ({(depth - 2) // 6} blocks per stage); "
        f"see `resnet_cifar` for the arguments."
    )
    registry.register(f"resnet{depth}", build, inputs=requirements.IMAGES)


for _depth in DEPTHS:
    _register(_depth)
