"""What a `--dataset` gives a model, described without reading it: `DataDescription`.

This module owns describing a dataset the way `tfdp.app.compatibility` needs
it (one example's feature shape and dtype, classes, split names, token
vocabulary) at two moments of a `tfdp-train` run:

- `describe_before_strategy`: from static metadata only (a TFDS dataset's
  `dataset_info`, the built-in synthetic sources' sizes, the tfrecord flags).
  It starts no TensorFlow runtime and reads no record: the distribution
  strategy must be built first (`MultiWorkerMirroredStrategy` configures
  collectives at start-up), and a refusal here costs a second. Datasets it
  cannot describe that way (your `python:` code) give `None`.
- `describe_source`: from a built `pipelines.Source` and its features' spec,
  once the strategy exists (the element spec is then exact, e.g. the size of
  your TFRecord images).

It does not judge whether a model fits (`tfdp.app.compatibility` does) and
does not build pipelines (`pipelines` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from tfdp.app import user_data

#: Built-in registered sources described from their default constructor
#: arguments (constructing them creates no tensor).
_SYNTHETIC = ("synthetic_images", "synthetic_tokens")
_INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataDescription:
    """One example of a dataset, as a model sees it before preprocessing.

    Attributes:
        name: the `--dataset` value, e.g. `"digits"`.
        shape: one example's feature shape without the batch axis, `None`
            for a size that varies between examples (e.g. `(None,)` for
            token sequences of any length); `None` when not known before
            the data is read (your TFRecord images without `--image_size`).
        dtype: the features' dtype name (`"uint8"`, `"int32"`, `"float32"`,
            `"string"`), or `None` when not known yet.
        num_classes: label classes, or `None` when unknown.
        splits: the split names, or `None` when any name is accepted (the
            synthetic sources) or they are not known yet.
        vocab_size: token ids are below this (token datasets that say so).
        max_length: the longest token sequence (token datasets that say so).
        kind_hint: the input kind when `shape`/`dtype` are not known yet
            (`"images"` for `--dataset=tfrecord`).
        unavailable: why the data cannot be read as it is (a TFDS dataset
            that is not prepared), or `None`.
    """

    name: str
    shape: tuple | None
    dtype: str | None
    num_classes: int | None
    splits: tuple | None = None
    vocab_size: int | None = None
    max_length: int | None = None
    kind_hint: str | None = None
    unavailable: str | None = None

    @property
    def kind(self) -> str | None:
        """`"images"`, `"features"`, `"tokens"` (see `models.requirements`),
        `"encoded"` (strings: undecoded images or text), `"other"`, or `None`
        when not known before the data is read."""
        if self.shape is None or self.dtype is None:
            return self.kind_hint
        if self.dtype == "string":
            return "encoded"
        if self.dtype in _INTEGER_DTYPES and len(self.shape) == 1:
            return "tokens"
        if len(self.shape) == 3 and (self.dtype == "uint8" or self.dtype.startswith(("float", "bfloat"))):
            return "images"
        if self.dtype == "uint8" or self.dtype in _INTEGER_DTYPES or self.dtype.startswith(
                ("float", "bfloat")):
            return "features"
        return "other"

    def describe(self) -> str:
        """E.g. "8x8x1 uint8 images" or "token ids of varying length (int32)"."""
        kind = self.kind
        if self.shape is None:
            return {"images": "images of a size known once read"}.get(kind, "examples")
        if kind == "images":
            dims = "x".join("?" if d is None else str(d) for d in self.shape)
            return f"{dims} {self.dtype} images"
        if kind == "tokens":
            length = ("of varying length" if self.shape[0] is None
                      else f"of length {self.shape[0]}")
            return f"token ids {length} ({self.dtype})"
        if kind == "encoded":
            return "strings (encoded images or text, not decoded)"
        return f"{self.dtype} features of shape {tuple(self.shape)}"


def _tfds_description(name: str, builder, *, splits_if_unprepared=None,
                      unavailable: str | None = None) -> DataDescription:
    info = builder.info
    if not info.supervised_keys:
        return DataDescription(
            name=name, shape=None, dtype=None, num_classes=None,
            unavailable=(f"TFDS dataset {name!r} has no supervised (features, label) keys; read "
                         f"it in your own tf.data code (--dataset=python:module:function)"))
    feature_key, label_key = info.supervised_keys[:2]
    feature, label = info.features[feature_key], info.features[label_key]
    shape = getattr(feature, "shape", None)
    dtype = getattr(feature, "np_dtype", None)
    prepared = builder.is_prepared()
    splits = tuple(sorted(info.splits.keys())) if prepared else splits_if_unprepared
    return DataDescription(
        name=name, shape=None if shape is None else tuple(shape),
        dtype=None if dtype is None else _dtype_name(dtype),
        num_classes=getattr(label, "num_classes", None), splits=splits,
        unavailable=None if prepared else unavailable,
    )


def _dtype_name(np_dtype) -> str:
    import numpy as np

    dtype = np.dtype(np_dtype)
    return "string" if dtype.kind in "OSU" else dtype.name


@contextlib.contextmanager
def _quiet_tfds():
    """TFDS logs every metadata read ("Load dataset info from ..."); a refusal is one line."""
    from absl import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def _not_prepared(name: str, builder, data_dir: str | None) -> str:
    where = f", data_dir={data_dir!r}" if data_dir else ""
    return (f"TFDS dataset {name!r} is not prepared in {builder.data_dir} and training never "
            f"downloads; prepare it once with python -c \"from tfdp import pipelines; "
            f"pipelines.prepare_tfds({name!r}{where})\" (needs network access), or pass "
            f"--data_dir where it is prepared")


def describe_before_strategy(config) -> DataDescription | None:
    """`config`'s dataset described from static metadata; `None` if that cannot be done.

    Starts no TensorFlow runtime and reads no example. The bundled digits are
    described from their builder even before they are prepared (the first
    dataset built prepares them).

    Args:
        config: a `RunConfig` (reads `dataset`, `data_dir` and, for
            `--dataset=tfrecord`, the file flags).
    """
    import tensorflow_datasets as tfds

    from tfdp import pipelines
    from tfdp.pipelines import digits

    name = config.dataset
    if name.startswith(user_data.PYTHON_PREFIX):
        return None  # known once the function has run, after the strategy
    if name == user_data.TFRECORD:
        size = config.image_size
        return DataDescription(
            name=name, dtype="uint8" if size else None, kind_hint="images",
            shape=(size, size, config.image_channels) if size else None,
            num_classes=config.num_classes,
            splits=("train", "test") if config.eval_files else ("train",),
        )
    if name in _SYNTHETIC:
        return describe_synthetic(pipelines.get_source(name))
    if name in pipelines.known_sources() and name != digits.NAME:
        return None  # a source you registered: described once it is built
    with _quiet_tfds():
        if name == digits.NAME:
            data_dir = os.path.abspath(os.path.expanduser(
                config.data_dir or digits.default_data_dir()))
            # Not yet prepared, digits still has its two splits: a check
            # against them must not wait for the first build.
            return _tfds_description(name, digits.Digits(data_dir=data_dir),
                                     splits_if_unprepared=digits.SPLITS)
        builder = tfds.builder(name, data_dir=config.data_dir)
        return _tfds_description(name, builder,
                                 unavailable=_not_prepared(name, builder, config.data_dir))


def describe_synthetic(source) -> DataDescription | None:
    """A `pipelines.SyntheticImages` or `SyntheticTokens`, from its sizes."""
    from tfdp import pipelines

    if isinstance(source, pipelines.SyntheticImages):
        encoded = source.encoding is not None
        return DataDescription(
            name=source.name, shape=() if encoded else tuple(source.image_shape),
            dtype="string" if encoded else "uint8", num_classes=source.num_classes())
    if isinstance(source, pipelines.SyntheticTokens):
        return DataDescription(
            name=source.name, shape=(None,), dtype="int32", num_classes=source.num_classes(),
            vocab_size=source.vocab_size, max_length=source.max_length)
    return None


def describe_source(name: str, source, features, num_classes, *,
                    before: DataDescription | None = None) -> DataDescription:
    """A built source described from its features' spec (after the strategy exists).

    Args:
        name: the `--dataset` value.
        source: the `pipelines.Source`.
        features: the `tf.TensorSpec` of one example's features, as read
            (`SourceInfo.features`, or a dataset's `element_spec[0]`).
        num_classes: label classes, or None.
        before: what `describe_before_strategy` said (its split names are
            kept when the source cannot list its own), or `None`.
    """
    shape = getattr(features, "shape", None)
    dtype = getattr(features, "dtype", None)
    splits = before.splits if before is not None else None
    builder = getattr(source, "builder", None)  # a TFDS source lists its splits
    if builder is not None and builder.info.splits:
        splits = tuple(sorted(builder.info.splits.keys()))
    return DataDescription(
        name=name,
        shape=None if shape is None or shape.rank is None else tuple(shape.as_list()),
        dtype=None if dtype is None else dtype.name,
        num_classes=num_classes, splits=splits,
        vocab_size=getattr(source, "vocab_size", None),
        max_length=getattr(source, "max_length", None),
        kind_hint=before.kind_hint if before is not None else None,
    )
