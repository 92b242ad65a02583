"""Tests for `tfdp.pipelines.source_registry` and `tfdp.pipelines.tfds_source`: names, TFDS, errors."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp import pipelines
from pipeline_testing import collect, get_strategy, id_dataset, real_ids
from tfdp.pipelines import source as source_lib
from tfdp.pipelines import source_registry


def test_known_sources_are_the_registered_names():
    assert {"digits", "synthetic_images", "synthetic_tokens"} <= set(pipelines.known_sources())


def test_unknown_name_lists_the_known_sources_and_close_matches():
    with pytest.raises(ValueError) as error:
        pipelines.make_dataset("mnistt", strategy=get_strategy("default"), global_batch=4)
    message = str(error.value)
    assert "Unknown source name 'mnistt'" in message
    assert "digits, synthetic_images, synthetic_tokens" in message
    assert "TFDS dataset names (e.g. mnist, cifar10, imagenet2012" in message
    assert "Did you mean: mnist" in message


@pytest.mark.slow
def test_checking_a_name_reads_no_data_and_starts_no_runtime(tmp_path):
    # tfdp-train checks --dataset before it builds a MultiWorkerMirroredStrategy,
    # which must configure collective ops before TensorFlow initialises.
    code = (
        "from tfdp import pipelines\n"
        "from tensorflow.python.eager import context\n"
        "for name in ('digits', 'mnist', 'cifar10:3.0.2', 'synthetic_images'):\n"
        "    pipelines.check_source_name(name)\n"
        "print(context.context()._context_handle is None)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TFDP_DATA_DIR": str(tmp_path)})
    assert result.stdout.strip().splitlines()[-1] == "True", result.stderr
    assert not list(tmp_path.iterdir())  # digits was not prepared
    with pytest.raises(ValueError, match="Unknown source name 'mnistt'.*Did you mean: mnist"):
        pipelines.check_source_name("mnistt")


def test_register_source_refuses_to_replace_silently():
    source_registry.register_source("_test_source", lambda data_dir: pipelines.SyntheticImages())
    try:
        with pytest.raises(ValueError, match="already registered"):
            source_registry.register_source("_test_source", lambda data_dir: None)
        assert isinstance(pipelines.get_source("_test_source"), pipelines.SyntheticImages)
    finally:
        source_registry._REGISTRY.pop("_test_source")
    with pytest.raises(TypeError, match="`factory` must be a callable"):
        source_registry.register_source("_other", factory=3)


@pytest.mark.parametrize(
    "source,error,match",
    [
        (3, TypeError, r"`source` must be a source name.*Received: source=3 of type int"),
        ([1, 2], TypeError, r"of type list"),
    ],
)
def test_source_of_the_wrong_kind_is_a_type_error(source, error, match):
    with pytest.raises(error, match=match):
        pipelines.get_source(source)


def test_a_distributed_dataset_is_not_a_source():
    strategy = get_strategy("mirrored2")
    distributed = strategy.experimental_distribute_dataset(id_dataset(8).batch(4))
    with pytest.raises(TypeError, match="already a distributed dataset"):
        pipelines.get_source(distributed)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_any_tfds_dataset_by_name(strategy_name):
    strategy = get_strategy(strategy_name)
    with tfds.testing.mock_data(num_examples=21):
        train = pipelines.make_dataset(
            "mnist", strategy=strategy, global_batch=8, seed=0,
            preprocess=pipelines.normalize_images(),
        )
        steps = collect(train, strategy)
        evaluation = pipelines.make_dataset(
            "mnist", split="test", strategy=strategy, global_batch=8, training=False
        )
        eval_steps = collect(evaluation, strategy)
    assert len(steps) == train.steps_per_epoch == 2
    features, labels = steps[0][0]
    per_replica = 8 // strategy.num_replicas_in_sync
    assert features.shape == (per_replica, 28, 28, 1) and features.dtype == np.float32
    assert 0.0 <= features.min() and features.max() <= 1.0
    assert labels.shape == (per_replica,)
    assert train.pipeline_info.num_classes == 10
    assert sum(len(parts[0]) for step in eval_steps for parts in step) == 21


def test_missing_data_dir_is_an_error(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError) as error:
        pipelines.make_dataset(
            "mnist", data_dir=missing, strategy=get_strategy("default"), global_batch=4
        )
    message = str(error.value)
    assert f"Received: data_dir={missing!r}, which does not exist" in message
    assert "pipelines.prepare_tfds('mnist'" in message


def test_unprepared_dataset_says_where_it_looked_and_how_to_prepare(tmp_path):
    with pytest.raises(ValueError) as error:
        pipelines.make_dataset(
            "mnist", data_dir=str(tmp_path), strategy=get_strategy("default"), global_batch=4
        )
    message = str(error.value)
    assert "TFDS dataset 'mnist' is not prepared" in message
    assert str(tmp_path / "mnist") in message
    assert "training never downloads" in message
    assert f"tfds build mnist --data_dir={tmp_path}" in message


def test_unknown_split_lists_the_splits(digits_dir):
    with pytest.raises(ValueError, match=r"one of test, train.*Received: split='validation'"):
        pipelines.make_dataset(
            "digits", split="validation", data_dir=digits_dir,
            strategy=get_strategy("default"), global_batch=4,
        )


def test_describe_source(digits_dir):
    info = pipelines.describe_source("digits", split="test", data_dir=digits_dir)
    assert (info.name, info.split, info.num_examples, info.num_classes, info.num_files) == (
        "digits", "test", 360, 10, 8,
    )
    assert info.features == tf.TensorSpec((8, 8, 1), tf.uint8)
    assert info.label == tf.TensorSpec((), tf.int64)
    synthetic = pipelines.describe_source(pipelines.SyntheticTokens(num_examples=5))
    assert synthetic.num_examples == 5 and synthetic.features.shape.as_list() == [None]


def test_tfds_slicing_syntax_is_a_split(digits_dir):
    dataset = pipelines.make_dataset(
        "digits", split="test[:100]", data_dir=digits_dir,
        strategy=get_strategy("mirrored2"), global_batch=16, training=False,
    )
    assert dataset.num_examples == 100 and dataset.steps_per_epoch == 7


def test_counts_a_dataset_of_unknown_cardinality_once():
    filtered = id_dataset(30).filter(lambda x, y: x % 3 > 0)  # Unknown cardinality.
    source = pipelines.get_source(filtered)
    assert int(filtered.cardinality()) == source_lib.UNKNOWN
    assert source.num_examples("train") == 20
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(filtered, strategy=strategy, global_batch=4, training=False)
    assert sorted(real_ids(collect(dataset, strategy))) == [i for i in range(30) if i % 3]
