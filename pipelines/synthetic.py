"""Synthetic sources with configurable shapes, for benchmarks and tests.

This module owns two generated sources: `SyntheticImages` (uint8 images with
integer labels, optionally JPEG/PNG-encoded so decoding costs what it costs on
real data) and `SyntheticTokens` (variable-length int32 token sequences with
integer labels). Example `i` is a pure function of `(seed, i)` (stateless
random ops), so every process generates the same split in the same order and
element sharding partitions it. The data is random: good for measuring
throughput and checking plumbing, not for learning anything.

Registered as `"synthetic_images"` and `"synthetic_tokens"` with default
sizes; construct the classes for other shapes and pass the instance as
`make_dataset(source=...)`.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfdp import _checks
from tfdp.pipelines import source as source_lib

ENCODINGS = (None, "jpeg", "png")


def _seeds(seed: int, index: tf.Tensor, stream: int) -> tf.Tensor:
    """A stateless-op seed for stream `stream` of example `index`."""
    return tf.stack([tf.cast(seed * 1_000_003 + stream, tf.int64), index])


class SyntheticImages(source_lib.Source):
    """Random images with random labels.

    Elements are `(image, label)`: `image` is uint8 of shape `image_shape`
    (or a scalar tf.string holding its JPEG/PNG encoding when `encoding` is
    set: decode it in `preprocess`, e.g. with `pipelines.decode_image`), and
    `label` an int64 scalar in `[0, num_classes)`.

    Args:
        num_examples: examples in every split. Defaults to 1024.
        image_shape: `(height, width, channels)` with 1 or 3 channels.
            Defaults to `(32, 32, 3)`.
        num_classes: label range. Defaults to 10.
        encoding: `None` (default) for raw pixels, or `"jpeg"` / `"png"`.
        num_distinct: how many distinct encoded images to cycle through when
            `encoding` is set (they are encoded once, in Python). Defaults to 64.
        seed: makes the data reproducible. Defaults to 0.
    """

    name = "synthetic_images"

    def __init__(
        self,
        *,
        num_examples: int = 1024,
        image_shape: Sequence[int] = (32, 32, 3),
        num_classes: int = 10,
        encoding: str | None = None,
        num_distinct: int = 64,
        seed: int = 0,
    ):
        _checks.check_int("num_examples", num_examples, minimum=1)
        _checks.check_int("num_classes", num_classes, minimum=1)
        _checks.check_int("num_distinct", num_distinct, minimum=1)
        _checks.check_int("seed", seed, minimum=0)
        image_shape = tuple(image_shape)
        if (
            len(image_shape) != 3
            or not all(isinstance(d, int) and d > 0 for d in image_shape)
            or image_shape[2] not in (1, 3)
        ):
            raise ValueError(
                "`image_shape` must be (height, width, channels) with positive "
                f"integers and 1 or 3 channels. Received: image_shape={image_shape!r}"
            )
        if encoding not in ENCODINGS:
            raise ValueError(
                f"`encoding` must be one of {ENCODINGS}. Received: encoding={encoding!r}"
            )
        self.num_examples_per_split = num_examples
        self.image_shape = image_shape
        self._num_classes = num_classes
        self.encoding = encoding
        self.num_distinct = min(num_distinct, num_examples)
        self.seed = seed
        self._encoded: tf.Tensor | None = None

    def _image(self, index: tf.Tensor) -> tf.Tensor:
        pixels = tf.random.stateless_uniform(
            self.image_shape, _seeds(self.seed, index, 1), maxval=256, dtype=tf.int32
        )
        return tf.cast(pixels, tf.uint8)

    def _label(self, index: tf.Tensor) -> tf.Tensor:
        return tf.random.stateless_uniform(
            [], _seeds(self.seed, index, 2), maxval=self._num_classes, dtype=tf.int64
        )

    def _encoded_pool(self) -> tf.Tensor:
        if self._encoded is None:
            encode = tf.io.encode_jpeg if self.encoding == "jpeg" else tf.io.encode_png
            self._encoded = tf.stack(
                [encode(self._image(tf.constant(i, tf.int64))) for i in range(self.num_distinct)]
            )
        return self._encoded

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        del shuffle_files, seed
        if input_context is not None:
            raise ValueError("Synthetic sources are sharded by element, not by file.")
        return tf.data.Dataset.range(self.num_examples_per_split).map(self.example_at(split))

    def example_at(self, split):
        del split
        if self.encoding is None:
            return lambda i: (self._image(i), self._label(i))
        pool = self._encoded_pool()
        return lambda i: (tf.gather(pool, i % self.num_distinct), self._label(i))

    def num_examples(self, split):
        return self.num_examples_per_split

    def num_classes(self):
        return self._num_classes


class SyntheticTokens(source_lib.Source):
    """Random token sequences of random length, with random labels.

    Elements are `(tokens, label)`: `tokens` is int32 of shape `(length,)`
    with `min_length <= length <= max_length` and ids in `[1, vocab_size)`
    (0 is left free for padding), and `label` an int64 scalar in
    `[0, num_classes)`. Sequences differ in length, so pad or truncate them
    in `preprocess` (`pipelines.pad_tokens`) before they can be batched.

    Args:
        num_examples: examples in every split. Defaults to 1024.
        vocab_size: token id range. Defaults to 1000.
        min_length: shortest sequence. Defaults to 8.
        max_length: longest sequence. Defaults to 64.
        num_classes: label range. Defaults to 2.
        seed: makes the data reproducible. Defaults to 0.
    """

    name = "synthetic_tokens"

    def __init__(
        self,
        *,
        num_examples: int = 1024,
        vocab_size: int = 1000,
        min_length: int = 8,
        max_length: int = 64,
        num_classes: int = 2,
        seed: int = 0,
    ):
        _checks.check_int("num_examples", num_examples, minimum=1)
        _checks.check_int("vocab_size", vocab_size, minimum=2)
        _checks.check_int("min_length", min_length, minimum=1)
        _checks.check_int("max_length", max_length, minimum=min_length)
        _checks.check_int("num_classes", num_classes, minimum=1)
        _checks.check_int("seed", seed, minimum=0)
        self.num_examples_per_split = num_examples
        self.vocab_size = vocab_size
        self.min_length = min_length
        self.max_length = max_length
        self._num_classes = num_classes
        self.seed = seed

    def _example(self, index: tf.Tensor):
        length = tf.random.stateless_uniform(
            [],
            _seeds(self.seed, index, 3),
            minval=self.min_length,
            maxval=self.max_length + 1,
            dtype=tf.int32,
        )
        tokens = tf.random.stateless_uniform(
            [length], _seeds(self.seed, index, 4), minval=1, maxval=self.vocab_size,
            dtype=tf.int32,
        )
        label = tf.random.stateless_uniform(
            [], _seeds(self.seed, index, 5), maxval=self._num_classes, dtype=tf.int64
        )
        return tokens, label

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        del split, shuffle_files, seed
        if input_context is not None:
            raise ValueError("Synthetic sources are sharded by element, not by file.")
        return tf.data.Dataset.range(self.num_examples_per_split).map(self._example)

    def example_at(self, split):
        del split
        return self._example

    def num_examples(self, split):
        return self.num_examples_per_split

    def num_classes(self):
        return self._num_classes
