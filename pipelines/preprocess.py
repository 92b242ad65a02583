"""Per-example preprocessing for `make_dataset(preprocess=...)`.

This module owns the transforms applied to one unbatched `(features, label)`
example inside the input pipeline's parallel map: image decoding and
normalisation, CIFAR-style random crop + horizontal flip, and token-sequence
padding/truncation, plus `compose` to chain them.

A preprocess is any callable `(features, label) -> (features, label)`. A
random one sets the attribute `needs_seed = True` and takes a third argument,
`seed`: an int64 tensor of shape `(2,)` that `make_dataset` draws per example
from its `seed`, so augmentation is reproducible (stateless random ops) even
though the map runs in parallel, and differs from epoch to epoch.

Batching, shuffling and padding of partial batches are `tfdp.pipelines.distributed_dataset`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from tfdp import _checks


Preprocess = Callable[..., tuple]


def _single_tensor(features, where: str) -> tf.Tensor:
    if not isinstance(features, tf.Tensor):
        raise TypeError(
            f"{where} expects the features of each example to be one dense "
            f"tensor. Received: features={features!r}. For nested features, "
            f"apply it to the right entry yourself, e.g. "
            f"preprocess=lambda x, y: ({{**x, 'image': f(x['image'], y)[0]}}, y)."
        )
    return features


class Normalize:
    """Casts images to `dtype`, scales them, then standardises per channel.

    `x -> (cast(x) * scale - mean) / std`.

    Args:
        scale: multiplier applied first. Defaults to `1/255` (uint8 to [0, 1]).
        mean: per-channel mean (a number or one per channel) subtracted after
            scaling, or `None`. Defaults to `None`.
        std: per-channel standard deviation divided by after, or `None`.
        dtype: output dtype. Defaults to `"float32"`.
    """

    needs_seed = False

    def __init__(
        self,
        *,
        scale: float = 1.0 / 255.0,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
        dtype: str = "float32",
    ):
        if std is not None and any(s <= 0 for s in _as_tuple(std)):
            raise ValueError(f"`std` must be positive. Received: std={std!r}")
        self.scale = float(scale)
        self.mean = _as_tuple(mean)
        self.std = _as_tuple(std)
        self.dtype = tf.dtypes.as_dtype(dtype)

    def __call__(self, features, label):
        image = tf.cast(_single_tensor(features, "normalize_images"), self.dtype) * self.scale
        if self.mean is not None:
            image = image - tf.constant(self.mean, self.dtype)
        if self.std is not None:
            image = image / tf.constant(self.std, self.dtype)
        return image, label

    def __repr__(self):
        return f"normalize_images(scale={self.scale}, mean={self.mean}, std={self.std})"


def _as_tuple(value):
    if value is None:
        return None
    return tuple(value) if isinstance(value, (list, tuple)) else (float(value),)


class RandomCropFlip:
    """CIFAR-style augmentation: zero-pad, random crop back, random h-flip.

    Args:
        padding: pixels of zero padding on each side before cropping back to
            the original size. Defaults to 4. 0 disables the crop.
        flip: flip left-right with probability 1/2. Defaults to True.
    """

    needs_seed = True

    def __init__(self, *, padding: int = 4, flip: bool = True):
        _checks.check_int("padding", padding, minimum=0)
        self.padding = padding
        self.flip = bool(flip)

    def __call__(self, features, label, seed):
        image = _single_tensor(features, "random_crop_flip")
        if not image.shape.is_fully_defined() or image.shape.rank != 3:
            raise ValueError(
                "random_crop_flip needs images of a known (height, width, "
                f"channels) shape. Received: shape={image.shape}. Decode or "
                "resize to a fixed shape first."
            )
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        if self.padding:
            p = self.padding
            padded = tf.pad(image, [[p, p], [p, p], [0, 0]])
            image = tf.image.stateless_random_crop(padded, image.shape, seed=crop_seed)
        if self.flip:
            image = tf.image.stateless_random_flip_left_right(image, seed=flip_seed)
        return image, label

    def __repr__(self):
        return f"random_crop_flip(padding={self.padding}, flip={self.flip})"


class DecodeImage:
    """Decodes JPEG/PNG/GIF/BMP bytes into a uint8 image.

    Args:
        channels: 1 or 3. Defaults to 3.
        shape: `(height, width)` every image has, to give the decoded tensor
            a static shape (needed by `random_crop_flip` and for padding
            evaluation batches), or `None`. Defaults to `None`.
    """

    needs_seed = False

    def __init__(self, *, channels: int = 3, shape: Sequence[int] | None = None):
        if channels not in (1, 3):
            raise ValueError(f"`channels` must be 1 or 3. Received: channels={channels!r}")
        self.channels = channels
        self.shape = None if shape is None else tuple(shape)

    def __call__(self, features, label):
        image = tf.io.decode_image(features, channels=self.channels, expand_animations=False)
        if self.shape is not None:
            image = tf.ensure_shape(image, (*self.shape, self.channels))
        return image, label

    def __repr__(self):
        return f"decode_image(channels={self.channels}, shape={self.shape})"


class PadTokens:
    """Truncates or pads token sequences to exactly `length` tokens.

    Keeps the first `length` tokens of longer sequences; appends `pad_id` to
    shorter ones.

    Args:
        length: output length. Must be positive.
        pad_id: the padding token. Defaults to 0.
    """

    needs_seed = False

    def __init__(self, *, length: int, pad_id: int = 0):
        _checks.check_int("length", length)
        self.length = length
        self.pad_id = pad_id

    def __call__(self, features, label):
        tokens = _single_tensor(features, "pad_tokens")[: self.length]
        padding = self.length - tf.shape(tokens)[0]
        tokens = tf.pad(tokens, [[0, padding]], constant_values=self.pad_id)
        return tf.ensure_shape(tokens, (self.length,)), label

    def __repr__(self):
        return f"pad_tokens(length={self.length}, pad_id={self.pad_id})"


class Compose:
    """Applies preprocess functions in order; random ones get their own seed."""

    def __init__(self, *fns: Preprocess):
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"compose expects callables. Received: {fn!r}")
        self.fns = fns
        self.needs_seed = any(getattr(fn, "needs_seed", False) for fn in fns)

    def __call__(self, features, label, seed=None):
        seeds = (
            tf.unstack(tf.random.experimental.stateless_split(seed, len(self.fns)))
            if self.needs_seed
            else [None] * len(self.fns)
        )
        for fn, fn_seed in zip(self.fns, seeds):
            if getattr(fn, "needs_seed", False):
                features, label = fn(features, label, fn_seed)
            else:
                features, label = fn(features, label)
        return features, label

    def __repr__(self):
        return f"compose({', '.join(map(repr, self.fns))})"


def normalize_images(**kwargs) -> Normalize:
    """See `Normalize`."""
    return Normalize(**kwargs)


def random_crop_flip(**kwargs) -> RandomCropFlip:
    """See `RandomCropFlip`."""
    return RandomCropFlip(**kwargs)


def decode_image(**kwargs) -> DecodeImage:
    """See `DecodeImage`."""
    return DecodeImage(**kwargs)


def pad_tokens(**kwargs) -> PadTokens:
    """See `PadTokens`."""
    return PadTokens(**kwargs)


def compose(*fns: Preprocess) -> Compose:
    """Chains preprocess functions; see `Compose`."""
    return Compose(*fns)


def for_images(*, training: bool, augment: bool = False, **normalize_kwargs) -> Preprocess:
    """The usual image-classification preprocessing.

    Args:
        training: whether this is the training split (augmentation applies
            only there).
        augment: random crop + flip (CIFAR-style) when training. Defaults to
            False.
        **normalize_kwargs: passed to `Normalize` (`scale`, `mean`, `std`).

    Returns:
        `normalize_images(...)`, preceded by `random_crop_flip()` when
        `training and augment`.
    """
    normalize = Normalize(**normalize_kwargs)
    if training and augment:
        return Compose(RandomCropFlip(), normalize)
    return normalize
