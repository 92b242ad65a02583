"""TensorFlow Datasets as a `pipelines` source.

This module owns reading one TFDS dataset (`mnist`, `cifar10`,
`imagenet2012`, the bundled `digits`, ...) from a local `data_dir` as
`(features, label)` examples, and the file arithmetic behind file sharding:
TFDS writes every split as several TFRecord files and, given a
`tf.distribute.InputContext` in its `ReadConfig`, gives input pipeline `i`
files `i, i + n, i + 2n, ...` of the split. `context_shard_sizes` reproduces
that assignment from the split's metadata so every worker knows how many
examples every other worker will read, without reading them.

It never downloads: a training job's workers would all download at once. A
dataset that is not prepared fails with an error that says where TFDS looked
and how to prepare it (`prepare_tfds`). The digits builder is in
`tfdp.pipelines.digits`.
"""

from __future__ import annotations

import os

import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp.pipelines import source as source_lib


def _prepare_command(name: str, data_dir: str | None) -> str:
    where = f", data_dir={data_dir!r}" if data_dir else ""
    return (
        f"python -c \"import pipelines; pipelines.prepare_tfds({name!r}{where})\" "
        f"(needs network access once), or `tfds build {name}"
        f"{' --data_dir=' + data_dir if data_dir else ''}`"
    )


def prepare_tfds(name: str, *, data_dir: str | None = None) -> None:
    """Downloads and prepares TFDS dataset `name` into `data_dir`, once.

    Run it once per machine (or shared file system) before training; training
    itself never downloads.

    Args:
        name: a TFDS name, e.g. `"mnist"` or `"cifar10:3.0.2"`.
        data_dir: where to write; defaults to TFDS's own default
            (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).
    """
    tfds.builder(name, data_dir=data_dir).download_and_prepare()


class TFDSSource(source_lib.Source):
    """One TFDS dataset, read with `as_supervised=True`.

    Args:
        name: a registered TFDS name, optionally with config and version
            (`"cifar10"`, `"imagenet2012:5.1.0"`).
        data_dir: the TFDS data directory to read from; `None` for TFDS's
            default (`$TFDS_DATA_DIR` or `~/tensorflow_datasets`).

    Raises:
        ValueError: `name` is not a TFDS dataset, `data_dir` does not exist,
            or the dataset has no supervised `(features, label)` keys.
    """

    shards_by_file = True

    def __init__(self, *, name: str, data_dir: str | None = None):
        if data_dir is not None and not os.path.isdir(data_dir):
            raise ValueError(
                f"`data_dir` must be an existing directory holding prepared TFDS "
                f"datasets. Received: data_dir={data_dir!r}, which does not "
                f"exist. Create it and prepare the dataset there with "
                f"{_prepare_command(name, data_dir)}, or pass the directory "
                f"where it is prepared."
            )
        try:
            self._builder = tfds.builder(name, data_dir=data_dir)
        except tfds.core.registered.DatasetNotFoundError as error:
            raise ValueError(f"Unknown TFDS dataset name {name!r}.") from error
        self.name = name
        self._data_dir = data_dir
        # `read(split)` in TFDS' one deterministic order, per split: the
        # checks, descriptions and element specs of a run read each split
        # this way several times, at ~0.1 s of TFDS set-up each.
        self._plain_reads: dict[str, tf.data.Dataset] = {}
        info = self._builder.info
        if not info.supervised_keys:
            raise ValueError(
                f"TFDS dataset {name!r} has no supervised (features, label) keys, "
                f"so it cannot be read as (features, label) examples. Build a "
                f"tf.data.Dataset of (features, label) tuples from it and pass "
                f"that as `source` instead."
            )

    @property
    def builder(self) -> tfds.core.DatasetBuilder:
        """The underlying `tfds.core.DatasetBuilder`."""
        return self._builder

    def _split_info(self, split: str):
        """The split's metadata, or `None` when TFDS has none (a mocked
        dataset under `tfds.testing.mock_data`)."""
        try:
            return self._builder.info.splits[split]
        except (KeyError, ValueError):
            return None

    def check_split(self, split):
        # Reading is lazy (it opens no file); it surfaces "not prepared" and
        # "unknown split" before any strategy or collective is involved.
        self.read(split)

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        # Without `shuffle_files` TFDS reads in one deterministic order, the
        # same in every process, so element sharding partitions the split.
        plain = input_context is None and not shuffle_files and seed is None
        if plain and split in self._plain_reads:
            return self._plain_reads[split]  # a tf.data.Dataset is immutable
        dataset = self._read(split, input_context=input_context, shuffle_files=shuffle_files,
                             seed=seed)
        if plain:
            self._plain_reads[split] = dataset
        return dataset

    def _read(self, split, *, input_context, shuffle_files, seed):
        read_config = tfds.ReadConfig(input_context=input_context, shuffle_seed=seed)
        try:
            return self._builder.as_dataset(
                split=split,
                as_supervised=True,
                shuffle_files=shuffle_files,
                read_config=read_config,
            )
        except AssertionError as error:
            # TFDS signals "not prepared" with an AssertionError.
            looked_in = self._builder.data_dir
            raise ValueError(
                f"TFDS dataset {self.name!r} is not prepared: no data in "
                f"{looked_in!r} (data_dir={self._data_dir!r}), and training "
                f"never downloads. Prepare it once with "
                f"{_prepare_command(self.name, self._data_dir)}, or pass the "
                f"`data_dir` where it is prepared."
            ) from error
        except ValueError as error:
            if "split" not in str(error).lower():
                raise
            splits = sorted(self._builder.info.splits.keys())
            raise ValueError(
                f"`split` must name a split of TFDS dataset {self.name!r}"
                f"{' (one of ' + ', '.join(splits) + ')' if splits else ''}, "
                f"optionally sliced like 'train[:90%]'. Received: split={split!r}"
            ) from error

    def num_examples(self, split):
        info = self._split_info(split)
        if info is not None:
            return int(info.num_examples)
        return super().num_examples(split)

    def num_files(self, split):
        info = self._split_info(split)
        return None if info is None else len(info.file_instructions)

    def context_shard_sizes(self, split, num_pipelines):
        info = self._split_info(split)
        if info is None:
            return None
        instructions = info.file_instructions
        if len(instructions) < num_pipelines:
            return None
        # The assignment TFDS's reader makes: `instruction_ds.shard(n, i)`.
        return [
            sum(int(f.take) for f in instructions[i::num_pipelines])
            for i in range(num_pipelines)
        ]

    def record_files(self, split):
        info = self._split_info(split)
        keys = self._builder.info.supervised_keys
        if (info is None or self._builder.info.file_format.name != "TFRECORD"
                or len(keys) != 2 or not all(isinstance(k, str) for k in keys)):
            return None  # mocked metadata, other file formats, nested supervised keys
        # TFDS's own read instructions: the files of the (possibly sliced)
        # split, with the records to skip and take in each.
        return [source_lib.RecordFile(str(f.filename), int(f.skip), int(f.take))
                for f in info.file_instructions]

    def parse_record(self, split):
        del split
        features = self._builder.info.features
        image_key, label_key = self._builder.info.supervised_keys

        def parse(serialized):
            example = features.deserialize_example(serialized)
            return example[image_key], example[label_key]

        return parse

    def num_classes(self):
        label_key = self._builder.info.supervised_keys[1]
        feature = self._builder.info.features[label_key]
        return getattr(feature, "num_classes", None)
