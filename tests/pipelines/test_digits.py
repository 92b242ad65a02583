"""Tests for `tfdp.pipelines.digits`: the offline TFDS dataset and its preparation."""

import collections
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn import datasets

from tfdp import pipelines
from pipeline_testing import get_strategy
from tfdp.pipelines import digits


def test_written_as_tfds_shards_with_the_fixed_split(digits_dir):
    builder = tfds.builder("digits", data_dir=digits_dir)
    assert builder.is_prepared()
    for split, size in (("train", 1437), ("test", 360)):
        info = builder.info.splits[split]
        assert info.num_examples == size
        assert info.num_shards == digits.NUM_SHARDS
        prefix = f"digits-{split}.tfrecord"
        files = [f for f in os.listdir(builder.data_dir) if f.startswith(prefix)]
        assert len(files) == digits.NUM_SHARDS


def test_examples_are_sklearn_digits_scaled_to_uint8(digits_dir):
    reference = datasets.load_digits()
    indices = digits.split_indices()
    assert tuple(sorted(indices)) == digits.SPLITS  # what checks before preparing rely on
    assert not set(indices["train"]) & set(indices["test"])
    assert len(indices["train"]) + len(indices["test"]) == len(reference.target)
    source = pipelines.get_source("digits", data_dir=digits_dir)
    read = collections.Counter(
        (image.tobytes(), int(label)) for image, label in source.read("test").as_numpy_iterator()
    )
    expected = collections.Counter(
        (
            np.round(reference.images[i] * 255.0 / 16.0).astype(np.uint8)[..., None].tobytes(),
            int(reference.target[i]),
        )
        for i in indices["test"]
    )
    assert read == expected
    # Stratified: every class is in the test split in proportion.
    assert sorted(collections.Counter(label for _, label in read.elements()).values())[0] >= 34


def test_prepare_is_idempotent(digits_dir):
    marker = os.path.join(digits_dir, "digits", "1.0.0", "dataset_info.json")
    before = os.stat(marker).st_mtime_ns
    assert pipelines.prepare_digits(digits_dir) == digits_dir
    assert os.stat(marker).st_mtime_ns == before


def test_default_data_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(digits.DATA_DIR_ENV, str(tmp_path))
    assert pipelines.default_data_dir() == str(tmp_path)
    monkeypatch.delenv(digits.DATA_DIR_ENV)
    assert pipelines.default_data_dir() == os.path.expanduser("~/tensorflow_datasets")


@pytest.mark.slow
def test_generated_on_first_use_in_the_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(digits.DATA_DIR_ENV, str(tmp_path / "new"))
    info = pipelines.describe_source("digits")
    assert info.num_examples == 1437
    assert tfds.builder("digits", data_dir=str(tmp_path / "new")).is_prepared()


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "test"])
def test_digits_pipeline_shards_by_file(split, digits_dir):
    dataset = pipelines.make_dataset(
        "digits", split=split, data_dir=digits_dir, strategy=get_strategy("mirrored2"),
        global_batch=32, training=split == "train",
    )
    assert dataset.pipeline_info.shard_mode == "file"


def test_preparing_prints_nothing_on_stdout(tmp_path, capfd):
    # Whichever worker prepares the data must stay quiet: only the chief prints.
    pipelines.prepare_digits(str(tmp_path))
    assert capfd.readouterr().out == ""
