"""Your own TFRecord files: PNG-encoded digits written by the test, read back
exactly, sharded by file, counted once."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfdp import pipelines
from tfdp.pipelines import digits as digits_lib
from tfdp.pipelines.tfrecord_source import TFRecordSource


def write_digits_tfrecords(directory, *, num_files: int, count: int | None = None):
    """All (or the first `count`) 1,797 digits as PNG `tf.train.Example`s in
    `num_files` files, in order; returns (images uint8 (N, 8, 8, 1), labels)."""
    images, labels = digits_lib.load_arrays()
    images = (images * (255 / 16)).round().astype(np.uint8)[..., None]  # float64 product
    labels = labels.astype(np.int64)
    if count is not None:
        images, labels = images[:count], labels[:count]
    os.makedirs(directory, exist_ok=True)
    for index, part in enumerate(np.array_split(np.arange(len(labels)), num_files)):
        with tf.io.TFRecordWriter(os.path.join(directory, f"digits-{index:05d}.tfrecord")) as w:
            for i in part:
                example = tf.train.Example(features=tf.train.Features(feature={
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[tf.io.encode_png(images[i]).numpy()])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[labels[i]])),
                }))
                w.write(example.SerializeToString())
    return images, labels


@pytest.fixture(scope="module")
def digits_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("digits_tfrecord")
    images, labels = write_digits_tfrecords(directory, num_files=5, count=500)
    return str(directory), images, labels


def _source(directory, **kwargs):
    return TFRecordSource(files={"train": os.path.join(directory, "digits-*.tfrecord")},
                          channels=1, **kwargs)


@pytest.mark.slow
def test_reads_every_example_back_in_file_and_record_order(digits_files):
    directory, images, labels = digits_files
    source = _source(directory)
    info = source.describe("train")
    assert (info.num_examples, info.num_classes, info.num_files) == (500, 10, 5)
    assert info.features.shape == (8, 8, 1) and info.features.dtype == tf.uint8
    read = list(source.read("train").as_numpy_iterator())
    # The whole split: file after file, each in record order.
    np.testing.assert_array_equal(np.stack([image for image, _ in read]), images)
    np.testing.assert_array_equal([label for _, label in read], labels)


def test_pipelines_read_whole_files_that_partition_the_split(digits_files):
    directory, _, _ = digits_files
    source = _source(directory)
    sizes = source.context_shard_sizes("train", 2)
    assert sizes == [300, 200]  # files 0, 2, 4 and 1, 3 of 100 examples each
    seen = []
    for index in range(2):
        context = tf.distribute.InputContext(2, index, 2)
        part = list(source.read("train", input_context=context).as_numpy_iterator())
        assert len(part) == sizes[index]
        seen += [(int(l), i.tobytes()) for i, l in part]
    whole = [(int(l), i.tobytes()) for i, l in source.read("train").as_numpy_iterator()]
    assert sorted(seen) == sorted(whole)
    assert source.context_shard_sizes("train", 6) is None  # fewer files than pipelines


def test_the_count_is_made_once_and_cached(digits_files, tmp_path):
    directory, _, _ = digits_files
    assert _source(directory, count_cache_dir=str(tmp_path)).num_examples("train") == 500
    caches = list(tmp_path.glob("tfrecord-counts-*.json"))
    assert len(caches) == 1
    assert json.loads(caches[0].read_text()) == {"files": [100] * 5, "max_label": 9}
    # A second source reads the cache: make it say something else to prove it.
    caches[0].write_text(json.dumps({"files": [1, 1, 1, 1, 1], "max_label": 3}))
    again = _source(directory, count_cache_dir=str(tmp_path))
    assert again.num_examples("train") == 5 and again.num_classes() == 4


def test_a_given_count_shards_by_record_before_decoding(digits_files):
    directory, _, _ = digits_files
    source = _source(directory, num_examples={"train": 500}, num_classes=10)
    assert not source.shards_by_file
    assert source.context_shard_sizes("train", 3) == [167, 167, 166]
    whole = [l for _, l in source.read("train").as_numpy_iterator()]
    parts = [[l for _, l in source.read(
        "train", input_context=tf.distribute.InputContext(3, i, 3)).as_numpy_iterator()]
        for i in range(3)]
    assert [len(p) for p in parts] == [167, 167, 166]
    assert sorted(sum(parts, [])) == sorted(whole)


@pytest.mark.slow
def test_make_dataset_trains_on_it_exactly_once_per_epoch(digits_files):
    import tfdp

    directory, _, labels = digits_files
    strategy = tfdp.make_strategy(cpu_replicas=2)
    batch = tfdp.BatchConfig.from_global(50, strategy.num_replicas_in_sync)
    dataset = pipelines.make_dataset(_source(directory), split="train", strategy=strategy,
                                     batch=batch, training=True, seed=1)
    assert dataset.pipeline_info.steps_per_epoch == 10
    seen = []
    for _, label in dataset:
        for part in strategy.experimental_local_results(label):
            seen += list(part.numpy())
    assert sorted(seen) == sorted(labels)


def test_bad_files_and_records_are_refused_clearly(digits_files, tmp_path):
    directory, _, _ = digits_files
    with pytest.raises(ValueError, match="matches no file"):
        TFRecordSource(files={"train": str(tmp_path / "nothing-*")}).describe("train")
    with pytest.raises(ValueError, match="one of the splits given files: train"):
        _source(directory).check_split("test")
    with pytest.raises(ValueError, match="Cannot read an image from feature 'image/jpeg'"):
        _source(directory, image_key="image/jpeg").describe("train")


def test_resizing_gives_every_image_the_asked_size(digits_files):
    directory, _, _ = digits_files
    source = _source(directory, image_size=(32, 32))
    image, _ = next(iter(source.read("train")))
    assert image.shape == (32, 32, 1) and image.dtype == tf.uint8


def test_unlabelled_records_read_label_minus_one(digits_files):
    directory, images, _ = digits_files
    source = _source(directory, label_key=None)
    assert source.num_classes() is None and source.num_examples("train") == 500
    image, label = next(iter(source.read("train")))
    assert int(label) == -1 and image.shape == (8, 8, 1)
