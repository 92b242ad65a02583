"""Tests for `tfdp.pipelines.digits`: the offline TFDS dataset and its preparation."""

import collections
import hashlib
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

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


#: sha256 of the bundled images' bytes followed by the labels' bytes.
BUNDLED_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"


def test_bundled_arrays_are_the_uci_digits():
    images, labels = digits.load_arrays()
    assert (images.shape, images.dtype, labels.shape, labels.dtype) == (
        (1797, 8, 8), np.uint8, (1797,), np.uint8)
    assert images.min() == 0 and images.max() == 16 and set(labels) == set(range(10))
    assert list(np.bincount(labels)) == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest() == BUNDLED_SHA256
    with pytest.raises(ValueError, match="read-only"):
        images[0, 0, 0] = 1  # shared by every caller


def test_bundled_arrays_and_split_are_scikit_learns():
    """Where scikit-learn is installed (not by tfdp): the same digits and the same split."""
    datasets = pytest.importorskip("sklearn.datasets")
    model_selection = pytest.importorskip("sklearn.model_selection")
    reference = datasets.load_digits()
    images, labels = digits.load_arrays()
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(labels, reference.target)
    train, test = model_selection.train_test_split(
        np.arange(len(labels)), test_size=digits.TEST_SIZE, random_state=0,
        stratify=reference.target)
    indices = digits.split_indices()
    np.testing.assert_array_equal(indices["train"], np.sort(train))
    np.testing.assert_array_equal(indices["test"], np.sort(test))


def test_examples_are_the_bundled_digits_scaled_to_uint8(digits_dir):
    images, labels = digits.load_arrays()
    indices = digits.split_indices()
    assert tuple(sorted(indices)) == digits.SPLITS  # what checks before preparing rely on
    assert not set(indices["train"]) & set(indices["test"])
    assert len(indices["train"]) + len(indices["test"]) == len(labels)
    assert len(indices["test"]) == digits.TEST_SIZE
    source = pipelines.get_source("digits", data_dir=digits_dir)
    read = collections.Counter(
        (image.tobytes(), int(label)) for image, label in source.read("test").as_numpy_iterator()
    )
    expected = collections.Counter(
        (
            np.round(images[i] * 255.0 / 16.0).astype(np.uint8)[..., None].tobytes(),
            int(labels[i]),
        )
        for i in indices["test"]
    )
    assert read == expected
    # Stratified: every class is in the test split in proportion (360 / 1797 of it).
    counts = collections.Counter(label for _, label in read.elements())
    for label, total in enumerate(np.bincount(labels)):
        assert abs(counts[label] - total * len(indices["test"]) / len(labels)) < 1


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
