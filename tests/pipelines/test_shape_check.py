"""Tests for `tfdp.pipelines.shape_check.check_model_compatible`."""

import keras
import pytest
import tensorflow as tf

from tfdp import pipelines
from pipeline_testing import get_strategy


@pytest.fixture(scope="module")
def images():
    source = pipelines.SyntheticImages(num_examples=8, image_shape=(8, 8, 1), num_classes=10)
    return pipelines.make_dataset(
        source, strategy=get_strategy("default"), global_batch=4,
        preprocess=pipelines.normalize_images(),
    )


def _model(input_shape=(8, 8, 1), units=10):
    inputs = keras.Input(input_shape)
    pooled = keras.layers.GlobalAveragePooling2D()(inputs)
    return keras.Model(inputs, keras.layers.Dense(units)(pooled))


def test_matching_model_passes(images):
    pipelines.check_model_compatible(images, _model())
    pipelines.check_model_compatible(images.pipeline_info, _model(input_shape=(None, None, 1)))


def test_wrong_input_shape_names_both_shapes(images):
    with pytest.raises(ValueError) as error:
        pipelines.check_model_compatible(images, _model(input_shape=(28, 28, 1)))
    message = str(error.value)
    assert "gives features of shape (8, 8, 1) (float32)" in message
    assert "expects input shape (None, 28, 28, 1)" in message
    assert "keras.Input(shape=(8, 8, 1))" in message


def test_wrong_class_count(images):
    with pytest.raises(ValueError, match=r"has 10 classes, but the model's output has 5 unit"):
        pipelines.check_model_compatible(images, _model(units=5))


def test_dict_features_match_inputs_by_name():
    source = tf.data.Dataset.range(8).map(
        lambda i: ({"a": tf.zeros((3,)), "b": tf.zeros((2,))}, i)
    )
    dataset = pipelines.make_dataset(source, strategy=get_strategy("default"), global_batch=4)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    good = keras.Model({"a": a, "b": b}, keras.layers.Concatenate()([a, b]))
    pipelines.check_model_compatible(dataset, good)
    c = keras.Input((2,), name="c")
    with pytest.raises(ValueError, match=r"gives feature 'b' but the model has no input named 'b'"):
        pipelines.check_model_compatible(dataset, keras.Model({"a": a, "c": c}, a))


def test_not_a_pipeline_dataset_is_a_type_error():
    with pytest.raises(TypeError, match="returned by pipelines.make_dataset"):
        pipelines.check_model_compatible(tf.data.Dataset.range(3), _model())


@pytest.mark.parametrize("strategy_name", ["mirrored2", "multiworker_local2"])
def test_checks_a_distributed_dataset_and_a_model_built_in_scope(strategy_name):
    # How a training program calls it: after make_dataset and building the
    # model, before the first step.
    strategy = get_strategy(strategy_name)
    source = pipelines.SyntheticImages(num_examples=8, image_shape=(8, 8, 1), num_classes=10)
    dataset = pipelines.make_dataset(
        source, strategy=strategy, global_batch=4, preprocess=pipelines.normalize_images()
    )
    with strategy.scope():
        good, bad = _model(), _model(units=5)
    pipelines.check_model_compatible(dataset, good)
    with pytest.raises(ValueError, match=r"has 10 classes, but the model's output has 5 unit"):
        pipelines.check_model_compatible(dataset, bad)
