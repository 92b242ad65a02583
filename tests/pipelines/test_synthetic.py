"""Tests for `tfdp.pipelines.synthetic`."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import pipelines
from pipeline_testing import collect, get_strategy


def _examples(source, split="train"):
    return list(source.read(split).as_numpy_iterator())


def test_images_have_the_configured_shape_and_are_reproducible():
    source = pipelines.SyntheticImages(num_examples=6, image_shape=(5, 4, 1), num_classes=3)
    examples = _examples(source)
    assert len(examples) == 6 == source.num_examples("train")
    assert all(x.shape == (5, 4, 1) and x.dtype == np.uint8 for x, _ in examples)
    assert all(0 <= y < 3 for _, y in examples)
    again = _examples(
        pipelines.SyntheticImages(num_examples=6, image_shape=(5, 4, 1), num_classes=3)
    )
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(examples, again))
    other = _examples(pipelines.SyntheticImages(num_examples=6, image_shape=(5, 4, 1), seed=1))
    assert not np.array_equal(examples[0][0], other[0][0])


@pytest.mark.parametrize("encoding", ["jpeg", "png"])
def test_encoded_images_decode_to_the_configured_shape(encoding):
    source = pipelines.SyntheticImages(num_examples=4, image_shape=(16, 12, 3), encoding=encoding)
    encoded, _ = _examples(source)[0]
    image = tf.io.decode_image(encoded, channels=3).numpy()
    assert image.shape == (16, 12, 3)
    if encoding == "png":  # Lossless: the raw source's first image.
        raw = pipelines.SyntheticImages(num_examples=4, image_shape=(16, 12, 3))
        np.testing.assert_array_equal(image, _examples(raw)[0][0])


def test_tokens_have_lengths_in_range_and_pad_to_a_batch():
    source = pipelines.SyntheticTokens(
        num_examples=50, vocab_size=20, min_length=3, max_length=9, num_classes=4
    )
    examples = _examples(source)
    lengths = {len(tokens) for tokens, _ in examples}
    assert min(lengths) >= 3 and max(lengths) <= 9 and len(lengths) > 3
    assert all(((1 <= t) & (t < 20)).all() and 0 <= y < 4 for t, y in examples)
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(
        source, strategy=strategy, global_batch=10, training=False,
        preprocess=pipelines.pad_tokens(length=6),
    )
    steps = collect(dataset, strategy)
    assert steps[0][0][0].shape == (5, 6)
    assert steps[0][0][0].dtype == np.int32


def test_registered_names_use_default_sizes():
    assert pipelines.get_source("synthetic_images").num_examples("train") == 1024
    assert pipelines.get_source("synthetic_tokens").num_classes() == 2


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: pipelines.SyntheticImages(num_examples=0), r"`num_examples` must be a positive integer"),
        (lambda: pipelines.SyntheticImages(image_shape=(4, 4)), r"`image_shape` must be"),
        (lambda: pipelines.SyntheticImages(image_shape=(4, 4, 2)), r"1 or 3 channels"),
        (lambda: pipelines.SyntheticImages(encoding="gif"), r"`encoding` must be one of"),
        (lambda: pipelines.SyntheticTokens(min_length=5, max_length=4), r"`max_length` .* >= 5"),
        (lambda: pipelines.SyntheticTokens(vocab_size=1), r"`vocab_size` must be an integer >= 2"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()
