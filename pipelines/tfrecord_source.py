"""Your own TFRecord files of `tf.train.Example`s as a `pipelines` source.

This module owns reading image-classification records from files (globs,
local or any filesystem `tf.io.gfile` reads), sharding them by file across
input pipelines (pipeline `i` of `n` reads files `i, i + n, ...`, as TFDS
does), and knowing how many examples each file holds without a counting pass
per worker per epoch: the count comes from the caller, or from one pass that
is cached (`tfrecord-counts-<hash>.json`, keyed on the files' names, sizes
and modification times) beside the files or in a directory the caller names.

By default records follow the TF Model Garden / TFDS image-classification
convention: `image/encoded` (JPEG or PNG bytes) and `image/class/label`
(int64). Other layouts: name the keys, or pass a `parse` function
`serialized -> (features, label)`.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Mapping, Sequence

import tensorflow as tf
from absl import logging

from tfdp.pipelines import source as source_lib

DEFAULT_IMAGE_KEY = "image/encoded"
DEFAULT_LABEL_KEY = "image/class/label"
#: Raw records per batch when counting (batching strings is cheap; a
#: per-record reduce costs ~50 us per record here).
_COUNT_BATCH = 4096


def expand_files(patterns: str | Sequence[str], *, what: str) -> list[str]:
    """The sorted files matching comma-separated globs or a list of them.

    Raises:
        ValueError: a pattern matches no file.
    """
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p.strip()]
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(tf.io.gfile.glob(pattern.strip()))
        if not matched:
            raise ValueError(
                f"{what}: {pattern!r} matches no file. Give a path or glob of TFRecord files "
                f"(e.g. 'data/train-*.tfrecord'), comma-separated for several."
            )
        files.extend(matched)
    return list(dict.fromkeys(files))


class TFRecordSource(source_lib.Source):
    """Image-classification examples from TFRecord files, one glob per split.

    Args:
        files: split name -> file glob (or comma-separated globs, or a list),
            e.g. `{"train": "data/train-*", "test": "data/test-*"}`.
        parse: `serialized tf.string -> (features, label)`; defaults to
            decoding `image_key` (JPEG/PNG, `channels` channels) and reading
            `label_key`.
        image_key: feature holding the encoded image. Defaults to
            `"image/encoded"`.
        label_key: int64 feature holding the class. Defaults to
            `"image/class/label"`; `None` for unlabelled records (scoring
            with `tfdp.predict`): every label reads -1.
        image_size: `(height, width)` every image is resized to; `None`
            (default) takes the first record's size and requires every image
            to have it.
        channels: image channels to decode to (1 grey, 3 RGB). Defaults to 3.
        num_classes: label classes; `None` reads the largest label in the
            counting pass (+1).
        num_examples: split name -> example count, when known; skips the
            counting pass for that split.
        count_cache_dir: where the counting pass's result is kept; `None`
            (default) keeps it beside the split's first file when that is
            writable.
    """

    name = "tfrecord"
    shards_by_file = True

    def __init__(
        self,
        *,
        files: Mapping[str, str | Sequence[str]],
        parse: Callable | None = None,
        image_key: str = DEFAULT_IMAGE_KEY,
        label_key: str | None = DEFAULT_LABEL_KEY,
        image_size: tuple[int, int] | None = None,
        channels: int = 3,
        num_classes: int | None = None,
        num_examples: Mapping[str, int] | None = None,
        count_cache_dir: str | None = None,
    ):
        if not files:
            raise ValueError("`files` must name at least one split's files, e.g. "
                             "files={'train': 'data/train-*.tfrecord'}.")
        if channels not in (1, 3, 4):
            raise ValueError(f"`channels` must be 1, 3 or 4. Received: channels={channels!r}")
        if image_size is not None and (len(image_size) != 2 or min(image_size) < 1):
            raise ValueError(
                f"`image_size` must be (height, width) in pixels. Received: {image_size!r}"
            )
        self._patterns = dict(files)
        self._files: dict[str, list[str]] = {}
        self._parse = parse
        self.image_key, self.label_key = image_key, label_key
        self.channels = channels
        self._image_size = tuple(image_size) if image_size is not None else None
        self._resize = image_size is not None
        self._num_classes = num_classes
        self._given_counts = dict(num_examples or {})
        # With given counts the source shards by record itself, not by file.
        self.shards_by_file = not self._given_counts
        self._counts: dict[str, dict] = {}
        self._count_cache_dir = count_cache_dir

    # -- files --------------------------------------------------------------

    def check_split(self, split):
        if split not in self._patterns:
            raise ValueError(
                f"`split` must be one of the splits given files: "
                f"{', '.join(sorted(self._patterns))}. Received: split={split!r}"
            )
        self.files(split)

    def files(self, split: str) -> list[str]:
        """The split's files, in the order they are read and sharded."""
        if split not in self._files:
            if split not in self._patterns:
                self.check_split(split)
            self._files[split] = expand_files(self._patterns[split], what=f"{split} files")
        return self._files[split]

    def num_files(self, split):
        return len(self.files(split))

    # -- parsing ------------------------------------------------------------

    def _decode(self, serialized, size):
        height, width = size
        spec = {self.image_key: tf.io.FixedLenFeature([], tf.string)}
        if self.label_key is not None:
            spec[self.label_key] = tf.io.FixedLenFeature([], tf.int64)
        parsed = tf.io.parse_single_example(serialized, spec)
        image = tf.io.decode_image(parsed[self.image_key], channels=self.channels,
                                   expand_animations=False)
        if self._resize:
            image = tf.cast(tf.clip_by_value(tf.round(
                tf.image.resize(image, (height, width))), 0, 255), tf.uint8)
        else:
            image = tf.ensure_shape(image, (height, width, self.channels))
        label = parsed[self.label_key] if self.label_key is not None else tf.constant(-1, tf.int64)
        return image, label

    def _size(self) -> tuple[int, int]:
        """The images' (height, width): given, or the first record's (read eagerly)."""
        if self._image_size is None:
            split = next(iter(self._patterns))
            first = next(iter(tf.data.TFRecordDataset(self.files(split)[:1]).take(1)), None)
            if first is None:
                raise ValueError(f"The first {split} file {self.files(split)[0]!r} holds no record.")
            try:
                parsed = tf.io.parse_single_example(
                    first, {self.image_key: tf.io.FixedLenFeature([], tf.string)})
                image = tf.io.decode_image(parsed[self.image_key], channels=self.channels,
                                           expand_animations=False)
            except (tf.errors.InvalidArgumentError, ValueError) as error:
                raise ValueError(
                    f"Cannot read an image from feature {self.image_key!r} of the first record "
                    f"of {self.files(split)[0]!r}: {str(error).splitlines()[0]}. Name the "
                    f"feature (image_key / --image_key) or pass a `parse` function."
                ) from None
            self._image_size = tuple(int(d) for d in image.shape[:2])
        return self._image_size

    def parse_function(self) -> Callable:
        """`serialized -> (features, label)`: what `read` applies to each record.

        With `records`, lets a program decode only the records it keeps
        (`tfdp.predict`'s `preprocess`).
        """
        return self._parse_fn()

    def records(self, split: str) -> tf.data.Dataset:
        """The split's raw serialized records, file after file in sorted order
        (the order `read(split)` gives them in), not decoded."""
        return tf.data.TFRecordDataset(self.files(split))

    def _parse_fn(self):
        if self._parse is not None:
            return self._parse
        with tf.init_scope():
            size = self._size()
        return lambda serialized: self._decode(serialized, size)

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        files = self.files(split)
        by_record = input_context is not None and split in self._given_counts
        if input_context is not None and not by_record:
            files = files[input_context.input_pipeline_id::input_context.num_input_pipelines]
        names = tf.data.Dataset.from_tensor_slices(files)
        if shuffle_files and not by_record:
            names = names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        # The whole split (no context, no shuffling) is read file after file
        # in sorted order: positions are what a user counts (tfdp.predict's
        # ids), and every process reads the same order (element sharding).
        # A pipeline's own files are read 4 at a time, deterministically.
        parallel = 1 if input_context is None and not shuffle_files else min(4, len(files))
        records = names.interleave(
            tf.data.TFRecordDataset, cycle_length=parallel, block_length=16,
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True,
        )
        if by_record:
            # The split's size is given but not each file's: every pipeline
            # reads the raw records in one order and decodes only its own.
            records = records.shard(input_context.num_input_pipelines,
                                    input_context.input_pipeline_id)
        return records.map(self._parse_fn(), num_parallel_calls=tf.data.AUTOTUNE,
                           deterministic=True)

    def record_files(self, split):
        if split in self._given_counts:
            return None  # the split's count is given, not each file's
        counts = self._count(split)["files"]
        return [source_lib.RecordFile(path, 0, count)
                for path, count in zip(self.files(split), counts)]

    def parse_record(self, split):
        del split
        return self._parse_fn()

    # -- counting -----------------------------------------------------------

    def _cache_path(self, split: str) -> str | None:
        files = self.files(split)
        key = hashlib.sha256()
        for path in files:
            stat = tf.io.gfile.stat(path)
            key.update(f"{path}\0{stat.length}\0{stat.mtime_nsec}\0".encode())
        key.update(f"{self.label_key}".encode())
        directory = self._count_cache_dir or os.path.dirname(files[0])
        return os.path.join(directory, f"tfrecord-counts-{key.hexdigest()[:16]}.json")

    def _count(self, split: str) -> dict:
        """`{"files": [records per file], "max_label": int | None}`, counted once."""
        if split in self._counts:
            return self._counts[split]
        cache = self._cache_path(split)
        if tf.io.gfile.exists(cache):
            with tf.io.gfile.GFile(cache) as f:
                self._counts[split] = json.load(f)
            return self._counts[split]
        files = self.files(split)
        logging.info("pipelines: counting the records of %d %s file(s) once (cached in %s); "
                     "pass the count (num_examples / --train_examples) to skip this.",
                     len(files), split, cache)
        counts, max_label = [], -1
        for path in files:
            batches = tf.data.TFRecordDataset(path).batch(_COUNT_BATCH)
            count = 0
            for batch in batches:
                count += int(tf.shape(batch)[0])
                if self._parse is None and self.label_key is not None:
                    labels = tf.io.parse_example(
                        batch, {self.label_key: tf.io.FixedLenFeature([], tf.int64)}
                    )[self.label_key]
                    max_label = max(max_label, int(tf.reduce_max(labels)))
            counts.append(count)
        result = {"files": counts, "max_label": max_label if max_label >= 0 else None}
        try:
            tf.io.gfile.makedirs(os.path.dirname(cache))
            scratch = f"{cache}.tmp-{os.getpid()}"
            with tf.io.gfile.GFile(scratch, "w") as f:
                json.dump(result, f)
            tf.io.gfile.rename(scratch, cache, overwrite=True)
        except (tf.errors.OpError, OSError) as error:
            logging.warning("pipelines: could not cache the record counts in %s (%s); every "
                            "run will count again. Pass count_cache_dir or the counts.",
                            cache, error)
        self._counts[split] = result
        return result

    def num_examples(self, split):
        if split in self._given_counts:
            return int(self._given_counts[split])
        return sum(self._count(split)["files"])

    def context_shard_sizes(self, split, num_pipelines):
        if split in self._given_counts:  # by record, before decoding (see `read`)
            total = int(self._given_counts[split])
            return [len(range(i, total, num_pipelines)) for i in range(num_pipelines)]
        if len(self.files(split)) < num_pipelines:
            return None
        counts = self._count(split)["files"]
        return [sum(counts[i::num_pipelines]) for i in range(num_pipelines)]

    def num_classes(self):
        if self._num_classes is not None or self._parse is not None:
            return self._num_classes
        split = "train" if "train" in self._patterns else next(iter(self._patterns))
        max_label = self._count(split)["max_label"]
        return None if max_label is None else max_label + 1
