"""The networks and synthetic data every benchmark case trains on.

This module owns the benchmark workloads: the 6-conv-layer CNN (as data,
`CNN_LAYERS`, so the Keras model here and the PyTorch model in
`tfdp.bench.peer_torch` are built from one definition), the
communication-bound MLP of the accumulation case, and in-memory synthetic
datasets whose cost is negligible next to a training step. It does not time
anything.

The CNN, on 32×32×3 images (channels last in Keras, first in PyTorch; the
same arithmetic):

| layer | filters | kernel | stride | output |
|---|---|---|---|---|
| conv1 + ReLU | 32 | 3×3, same padding | 2 | 16×16×32 |
| conv2 + ReLU | 32 | 3×3, same padding | 1 | 16×16×32 |
| conv3 + ReLU | 64 | 3×3, same padding | 2 | 8×8×64 |
| conv4 + ReLU | 64 | 3×3, same padding | 1 | 8×8×64 |
| conv5 + ReLU | 128 | 3×3, same padding | 2 | 4×4×128 |
| conv6 + ReLU | 128 | 3×3, same padding | 1 | 4×4×128 |
| global average pool | | | | 128 |
| dense (logits) | 10 | | | 10 |

288,298 parameters (1.15 MB of float32 gradients per step), about 9.7 M
multiply-adds per image forward. Stride 2 with "same" padding gives the same
output sizes in Keras and PyTorch (`padding=1`).
"""

from __future__ import annotations

import dataclasses

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class ConvLayer:
    """One 3×3 convolution with "same" padding and a ReLU.

    Attributes:
        filters: output channels.
        stride: 1 or 2 (2 halves height and width).
    """

    filters: int
    stride: int


#: The CNN's convolutions, in order (see the module docstring).
CNN_LAYERS = (
    ConvLayer(32, 2), ConvLayer(32, 1),
    ConvLayer(64, 2), ConvLayer(64, 1),
    ConvLayer(128, 2), ConvLayer(128, 1),
)

#: The MLP of the accumulation case: 784 -> 2048 -> 2048 -> 2048 -> 10, ReLU.
MLP_INPUT = 784
MLP_HIDDEN = (2048, 2048, 2048)


def cnn_parameter_count() -> int:
    """Parameters of the CNN (weights and biases), computed from `CNN_LAYERS`."""
    count, channels = 0, IMAGE_SHAPE[2]
    for layer in CNN_LAYERS:
        count += 9 * channels * layer.filters + layer.filters
        channels = layer.filters
    return count + channels * NUM_CLASSES + NUM_CLASSES


def mlp_parameter_count() -> int:
    """Parameters of the MLP (weights and biases)."""
    count, width = 0, MLP_INPUT
    for hidden in (*MLP_HIDDEN, NUM_CLASSES):
        count += width * hidden + hidden
        width = hidden
    return count


def build_cnn(seed: int = 0):
    """The CNN as a Keras model (build it inside `strategy.scope()`).

    Args:
        seed: weight-initialisation seed. Defaults to 0.

    Returns:
        A built `keras.Sequential` mapping `[batch, 32, 32, 3]` float32 images
        to `[batch, 10]` logits.
    """
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input(IMAGE_SHAPE)]
    for index, layer in enumerate(CNN_LAYERS, start=1):
        layers.append(keras.layers.Conv2D(
            layer.filters, 3, strides=layer.stride, padding="same", activation="relu",
            name=f"conv{index}",
        ))
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(NUM_CLASSES)]
    return keras.Sequential(layers, name="bench_cnn")


def build_mlp(seed: int = 0):
    """The ≈10 M-parameter MLP as a Keras model (inside `strategy.scope()`).

    Args:
        seed: weight-initialisation seed. Defaults to 0.

    Returns:
        A built `keras.Sequential` mapping `[batch, 784]` float32 to `[batch, 10]` logits.
    """
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((MLP_INPUT,))]
    layers += [keras.layers.Dense(width, activation="relu") for width in MLP_HIDDEN]
    layers.append(keras.layers.Dense(NUM_CLASSES))
    return keras.Sequential(layers, name="bench_mlp")


def synthetic_dataset(feature_shape, global_batch: int, *, distinct_batches: int = 4, seed: int = 0):
    """An endless dataset of global batches drawn from a few random batches in memory.

    Each worker yields the same batches (auto-sharding off); distributing the
    dataset splits every global batch into per-replica batches. Costs a
    memory copy per batch, so the step, not the input, is timed.

    Args:
        feature_shape: shape of one example, e.g. `(32, 32, 3)`.
        global_batch: examples per batch, over all replicas.
        distinct_batches: distinct random batches cycled through. Defaults to 4.
        seed: data seed. Defaults to 0.

    Returns:
        A `tf.data.Dataset` of `(float32 [global_batch, *feature_shape],
        int32 [global_batch])`, repeated forever.
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    n = distinct_batches * global_batch
    x = rng.normal(size=(n, *feature_shape)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        global_batch, drop_remainder=True
    ).cache().repeat().prefetch(2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.threading.private_threadpool_size = 1
    return dataset.with_options(options)
