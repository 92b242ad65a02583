"""What a data source is, as far as an input pipeline is concerned.

This module owns the `Source` interface and the two adapters that turn a
user's own data into one: `DatasetSource` (a `tf.data.Dataset`) and
`CallableSource` (a function `input_context -> tf.data.Dataset`). A source
yields unbatched `(features, label)` examples of one split and answers two
questions the sharding plan needs: how many examples there are, and how many
each input pipeline would get if the source shards itself (by file, for TFDS).

It does not batch, shuffle examples, shard by element or pad: that is
`tfdp.pipelines.distributed_dataset` and `tfdp.pipelines.sharding`. Named sources (TFDS, digits,
synthetic) live in their own modules and are looked up in `tfdp.pipelines.source_registry`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

import tensorflow as tf
from absl import logging

# Cardinality values, as `tf.data` reports them.
INFINITE = int(tf.data.INFINITE_CARDINALITY)
UNKNOWN = int(tf.data.UNKNOWN_CARDINALITY)


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """What a training program needs to know about a source before it builds
    a model or a dataset.

    Attributes:
        name: the source's name, e.g. `"digits"`, `"mnist"`, `"dataset"`.
        split: the split described, e.g. `"train"`.
        num_examples: examples in the split, or `pipelines.INFINITE` (-1).
        num_classes: label classes for classification sources, else `None`.
        features: `tf.TensorSpec` (or nest of them) of one example's features,
            before preprocessing, e.g. `TensorSpec((8, 8, 1), tf.uint8)`.
        label: `tf.TensorSpec` of one example's label.
        num_files: files the split is stored in (TFDS), or `None` when the
            source is not file-backed.
    """

    name: str
    split: str
    num_examples: int
    num_classes: int | None
    features: Any
    label: Any
    num_files: int | None = None


@dataclasses.dataclass(frozen=True)
class RecordFile:
    """One file's part of a split, read as raw TFRecord records (`Source.record_files`).

    Attributes:
        path: the file.
        skip: raw records before the split's first one in this file.
        take: records of the split in this file.
    """

    path: str
    skip: int
    take: int


class Source(abc.ABC):
    """A split-addressable collection of unbatched `(features, label)` examples.

    Subclasses implement `read`, and `context_shard_sizes` when they can give
    each input pipeline its own part of a split without reading the rest (a
    TFDS dataset stored as several files can).
    """

    #: A short name for logs and errors.
    name: str = "source"
    #: Whether `read(..., input_context=...)` shards by file (TFDS), which is
    #: what `shard_policy="file"` asks for.
    shards_by_file: bool = False

    def check_split(self, split: str) -> None:
        """Raises `ValueError` if `split` does not exist. Default: any split."""
        del split

    @abc.abstractmethod
    def read(
        self,
        split: str,
        *,
        input_context: tf.distribute.InputContext | None = None,
        shuffle_files: bool = False,
        seed: int | None = None,
    ) -> tf.data.Dataset:
        """Returns the split's examples, unbatched.

        Args:
            split: which split, e.g. `"train"`.
            input_context: `None` for every example of the split in one
                deterministic order (the same in every process, so that
                `Dataset.shard` partitions it). Otherwise only the part of
                the split the source assigns to that input pipeline.
            shuffle_files: shuffle the order files are read in, each epoch
                (file-backed sources only).
            seed: seed for `shuffle_files`.
        """

    def num_examples(self, split: str) -> int:
        """Examples in `split`; `INFINITE` if endless. Counts them if needed."""
        return count_examples(self.read(split), what=f"{self.name}/{split}")

    def context_shard_sizes(self, split: str, num_pipelines: int) -> list[int] | None:
        """Examples each of `num_pipelines` pipelines gets from `read(split,
        input_context=...)`, in pipeline order; `None` when the source cannot
        shard itself that many ways (then `tfdp.pipelines.distributed_dataset` shards by element).
        """
        del split, num_pipelines
        return None

    def num_files(self, split: str) -> int | None:
        """Files `split` is stored in, or `None` if the source is not file-backed."""
        del split
        return None

    def num_classes(self) -> int | None:
        """Label classes, for classification sources; `None` when unknown."""
        return None

    # -- addressing examples, so a resumed epoch can start anywhere -----------
    # (`tfdp.pipelines.seekable_order`). A source implements one of the two,
    # or neither: then a resume passes the skipped examples through `read`.

    def example_at(self, split: str) -> Callable[[tf.Tensor], Any] | None:
        """`int64 index -> (features, label)`: example `index` of `read(split)`'s
        order, as a graph function; `None` (default) when there is no random access."""
        del split
        return None

    def record_files(self, split: str) -> list[RecordFile] | None:
        """The split as raw TFRecord records of files with known counts, in
        `read(split)`'s file order (`read(split, input_context=...)` gives
        pipeline `i` of `n` files `i, i + n, ...`); `None` (default) when the
        source is not stored so, or the counts per file are not known."""
        del split
        return None

    def parse_record(self, split: str) -> Callable[[tf.Tensor], Any]:
        """`serialized tf.string -> (features, label)` for `record_files`' records."""
        raise NotImplementedError(f"{type(self).__name__} has no record files.")

    def describe(self, split: str) -> SourceInfo:
        """A `SourceInfo` for `split`."""
        self.check_split(split)
        features, label = self.read(split).element_spec
        return SourceInfo(
            name=self.name,
            split=split,
            num_examples=self.num_examples(split),
            num_classes=self.num_classes(),
            features=features,
            label=label,
            num_files=self.num_files(split),
        )


def count_examples(dataset: tf.data.Dataset, *, what: str) -> int:
    """Examples in `dataset`: its cardinality when known, else counted once.

    Args:
        dataset: an unbatched `tf.data.Dataset`.
        what: how to name the dataset in the log line when counting.

    Returns:
        The number of elements, or `INFINITE` (-1).
    """
    cardinality = int(dataset.cardinality())
    if cardinality != UNKNOWN:
        return cardinality
    logging.info(
        "pipelines: counting the examples of %s (its cardinality is unknown); "
        "wrap it in tf.data.experimental.assert_cardinality(n) to skip this pass.",
        what,
    )
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))


class DatasetSource(Source):
    """A `tf.data.Dataset` of unbatched `(features, label)` examples.

    The dataset is one split; it must produce its examples in the same order
    every time it is iterated (the tf.data default), so that sharding it by
    element partitions it.
    """

    name = "dataset"

    def __init__(self, *, dataset: tf.data.Dataset):
        self._dataset = dataset
        self._count: int | None = None

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        del split, shuffle_files, seed
        if input_context is not None:
            raise ValueError(
                "A tf.data.Dataset source cannot shard itself by file; shard it "
                "by element with shard_policy='data' (or 'auto')."
            )
        return self._dataset

    def num_examples(self, split):
        if self._count is None:
            self._count = count_examples(self._dataset, what="the dataset source")
        return self._count


class CallableSource(Source):
    """A function `input_context -> tf.data.Dataset` of unbatched examples.

    The function may shard by the context it is given (like the `dataset_fn`
    of `tf.distribute.Strategy.distribute_datasets_from_function`), or ignore
    it and return every example; `tfdp.pipelines.sharding` tells which by counting
    what it returns, and shards by element in the second case.
    """

    name = "callable"

    def __init__(self, *, fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]):
        self._fn = fn
        self._sizes: dict[int, list[int]] = {}
        self._count: int | None = None

    def _call(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = self._fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "A callable `source` must return a tf.data.Dataset of unbatched "
                f"(features, label) examples. Received: {type(dataset).__name__} "
                f"from source={self._fn!r}"
            )
        return dataset

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        del split, shuffle_files, seed
        return self._call(input_context or tf.distribute.InputContext())

    def num_examples(self, split):
        if self._count is None:
            self._count = count_examples(self.read(split), what="the callable source")
        return self._count

    def context_shard_sizes(self, split, num_pipelines):
        if num_pipelines not in self._sizes:
            self._sizes[num_pipelines] = [
                count_examples(
                    self._call(tf.distribute.InputContext(num_pipelines, i, num_pipelines)),
                    what=f"the callable source for input pipeline {i}/{num_pipelines}",
                )
                for i in range(num_pipelines)
            ]
        return self._sizes[num_pipelines]
