"""The source registry: from what a user passes as `source` to a `Source`.

This module owns the names `make_dataset` understands and the rules for the
other kinds of `source`:

- a registered name: `"digits"` (offline, generated on first use),
  `"synthetic_images"`, `"synthetic_tokens"`, or one added with
  `register_source`;
- any other TFDS dataset name (`"mnist"`, `"cifar10"`, `"imagenet2012"`, with
  an optional `:version` or `/config`), read from `data_dir`;
- a `tf.data.Dataset` of unbatched `(features, label)` examples;
- a callable `input_context -> tf.data.Dataset` of such examples;
- a `pipelines.Source` instance (e.g. `SyntheticImages(image_shape=...)`).

It does not read data; the sources do, and `tfdp.pipelines.distributed_dataset` builds the
pipeline around them.
"""

from __future__ import annotations

import difflib
from typing import Callable

import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp.pipelines import digits
from tfdp.pipelines import source as source_lib
from tfdp.pipelines import synthetic
from tfdp.pipelines import tfds_source

# name -> factory(data_dir) -> Source
_REGISTRY: dict[str, Callable[[str | None], source_lib.Source]] = {}


def register_source(
    name: str,
    factory: Callable[[str | None], source_lib.Source],
    *,
    overwrite: bool = False,
) -> None:
    """Makes `make_dataset(source=name, ...)` use `factory(data_dir)`.

    Args:
        name: the name to register; must not be taken unless `overwrite`.
        factory: called with the `data_dir` argument of `make_dataset` (may be
            `None`); returns a `pipelines.Source`.
        overwrite: replace an existing registration. Defaults to False.

    Raises:
        ValueError: `name` is empty or already registered.
        TypeError: `factory` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
    if not callable(factory):
        raise TypeError(
            f"`factory` must be a callable data_dir -> Source. Received: factory={factory!r}"
        )
    if name in _REGISTRY and not overwrite:
        raise ValueError(
            f"Source name {name!r} is already registered. Pass overwrite=True "
            f"to replace it."
        )
    _REGISTRY[name] = factory


def known_sources() -> tuple[str, ...]:
    """The registered source names (TFDS names are accepted besides these)."""
    return tuple(sorted(_REGISTRY))


def _tfds_names() -> list[str]:
    return tfds.list_builders(with_community_datasets=False)


def check_source_name(name: str) -> None:
    """Checks that `name` is a registered source or a TFDS dataset name.

    Reads no data and starts no TensorFlow runtime, so a program can validate
    its arguments before it builds a distribution strategy (which must come
    first: `MultiWorkerMirroredStrategy` has to configure collective ops
    before TensorFlow initialises).

    Raises:
        ValueError: the name is unknown; lists the registered names and the
            closest matches.
    """
    if name in _REGISTRY:
        return
    base = name.split(":")[0].split("/")[0]
    tfds_names = _tfds_names()
    if base in tfds_names:
        return
    close = difflib.get_close_matches(base, list(_REGISTRY) + tfds_names, n=3)
    raise ValueError(
        f"Unknown source name {name!r}. Known sources: "
        f"{', '.join(known_sources())}, or any of the {len(tfds_names)} TFDS "
        f"dataset names (e.g. mnist, cifar10, imagenet2012; see "
        f"tfds.list_builders())."
        + (f" Did you mean: {', '.join(close)}?" if close else "")
    )


def _from_name(name: str, data_dir: str | None) -> source_lib.Source:
    check_source_name(name)
    if name in _REGISTRY:
        return _REGISTRY[name](data_dir)
    return tfds_source.TFDSSource(name=name, data_dir=data_dir)


def get_source(
    source,
    *,
    split: str = "train",
    data_dir: str | None = None,
) -> source_lib.Source:
    """Turns what a user passes as `source` into a `pipelines.Source`.

    Args:
        source: a name, `tf.data.Dataset`, callable or `Source` (see module
            docstring).
        split: the split that will be read; for a `tf.data.Dataset` or a
            callable (which are one split already) it must stay `"train"`.
        data_dir: TFDS data directory for named sources.

    Returns:
        A `pipelines.Source`.

    Raises:
        TypeError: `source` is none of the accepted kinds.
        ValueError: unknown name, or `split`/`data_dir` given for a source
            that has no splits or files.
    """
    if data_dir is not None and not isinstance(data_dir, (str, bytes)) and not hasattr(
        data_dir, "__fspath__"
    ):
        raise TypeError(
            f"`data_dir` must be a path string or None. Received: data_dir={data_dir!r}"
        )
    if data_dir is not None:
        data_dir = str(data_dir)
    if isinstance(source, str):
        return _from_name(source, data_dir)
    if isinstance(source, source_lib.Source):
        return source
    if isinstance(source, tf.distribute.DistributedDataset):
        raise TypeError(
            "`source` is already a distributed dataset. Pass the unbatched "
            "tf.data.Dataset (or a function input_context -> tf.data.Dataset) "
            "instead; make_dataset distributes it."
        )
    if isinstance(source, tf.data.Dataset) or callable(source):
        kind = "a tf.data.Dataset" if isinstance(source, tf.data.Dataset) else "a callable"
        if data_dir is not None:
            raise ValueError(
                f"`data_dir` only applies to named sources; `source` is {kind}. "
                f"Remove data_dir={data_dir!r}."
            )
        if split != "train":
            raise ValueError(
                f"`split` selects a split of a named source; `source` is {kind}, "
                f"which is one split already. Remove split={split!r} and pass "
                f"the split's own dataset."
            )
        if isinstance(source, tf.data.Dataset):
            return source_lib.DatasetSource(dataset=source)
        return source_lib.CallableSource(fn=source)
    raise TypeError(
        "`source` must be a source name (str), a tf.data.Dataset, a callable "
        "input_context -> tf.data.Dataset, or a pipelines.Source. Received: "
        f"source={source!r} of type {type(source).__name__}"
    )


def describe_source(
    source,
    *,
    split: str = "train",
    data_dir: str | None = None,
) -> source_lib.SourceInfo:
    """What a program needs to know about `source` before building a model:
    example count, classes, feature and label specs.

    Args:
        source: as for `make_dataset`.
        split: which split. Defaults to `"train"`.
        data_dir: TFDS data directory for named sources.

    Returns:
        A `pipelines.SourceInfo`.
    """
    return get_source(source, split=split, data_dir=data_dir).describe(split)


register_source(
    digits.NAME,
    lambda data_dir: tfds_source.TFDSSource(
        name=digits.NAME, data_dir=digits.prepare(data_dir)
    ),
)
register_source("synthetic_images", lambda data_dir: synthetic.SyntheticImages())
register_source("synthetic_tokens", lambda data_dir: synthetic.SyntheticTokens())
