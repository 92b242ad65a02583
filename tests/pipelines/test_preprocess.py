"""Tests for `tfdp.pipelines.preprocess`, against NumPy references."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import pipelines


def _seed(a, b=0):
    return tf.constant([a, b], tf.int64)


def _image(height=6, width=5, channels=3):
    return np.arange(height * width * channels, dtype=np.uint8).reshape(height, width, channels)


def test_normalize_matches_numpy():
    image = _image()
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    out, label = pipelines.normalize_images(mean=mean, std=std)(tf.constant(image), 7)
    expected = (image.astype(np.float32) / 255.0 - np.array(mean, np.float32)) / np.array(
        std, np.float32
    )
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)
    assert out.dtype == tf.float32 and label == 7


def test_normalize_default_scales_to_unit_range():
    out, _ = pipelines.normalize_images()(tf.constant([[[0]], [[255]]], tf.uint8), 0)
    np.testing.assert_array_equal(out.numpy().ravel(), [0.0, 1.0])


def test_random_crop_flip_returns_a_window_of_the_padded_image():
    image = _image()
    padding = 2
    padded = np.pad(image, [(padding, padding), (padding, padding), (0, 0)])
    fn = pipelines.random_crop_flip(padding=padding)
    windows = set()
    for a in range(40):
        out, _ = fn(tf.constant(image), 0, _seed(a))
        out = out.numpy()
        assert out.shape == image.shape
        candidates = [
            (dy, dx, flipped)
            for dy in range(2 * padding + 1)
            for dx in range(2 * padding + 1)
            for flipped in (False, True)
            if np.array_equal(
                out[:, ::-1] if flipped else out, padded[dy:dy + 6, dx:dx + 5]
            )
        ]
        assert candidates, "output is not a (flipped) crop of the padded image"
        windows.add(candidates[0])
    assert len(windows) > 10  # Offsets and flips vary with the seed.


def test_random_crop_flip_is_a_function_of_its_seed():
    fn = pipelines.random_crop_flip()
    image = tf.constant(_image(8, 8))
    first, _ = fn(image, 0, _seed(3, 4))
    again, _ = fn(image, 0, _seed(3, 4))
    np.testing.assert_array_equal(first.numpy(), again.numpy())


def test_flip_only():
    image = _image()
    fn = pipelines.random_crop_flip(padding=0, flip=True)
    outputs = {fn(tf.constant(image), 0, _seed(a))[0].numpy().tobytes() for a in range(20)}
    assert outputs == {image.tobytes(), image[:, ::-1].tobytes()}


def test_pad_tokens_matches_numpy():
    fn = pipelines.pad_tokens(length=5, pad_id=-1)
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], []):
        out, _ = fn(tf.constant(tokens, tf.int32), 0)
        expected = (tokens + [-1] * 5)[:5]
        np.testing.assert_array_equal(out.numpy(), expected)
        assert out.shape == (5,)


def test_decode_image_round_trips_png():
    image = _image()
    encoded = tf.io.encode_png(tf.constant(image))
    out, _ = pipelines.decode_image(channels=3, shape=(6, 5))(encoded, 0)
    np.testing.assert_array_equal(out.numpy(), image)
    assert out.shape == (6, 5, 3)


def test_compose_applies_in_order_and_splits_the_seed():
    fn = pipelines.compose(
        pipelines.random_crop_flip(padding=1), pipelines.normalize_images(scale=2.0)
    )
    assert fn.needs_seed
    image = tf.constant(_image())
    out, _ = fn(image, 0, _seed(5))
    cropped, _ = pipelines.random_crop_flip(padding=1)(
        image, 0, tf.random.experimental.stateless_split(_seed(5), 2)[0]
    )
    np.testing.assert_allclose(out.numpy(), cropped.numpy().astype(np.float32) * 2.0)
    assert not pipelines.compose(pipelines.normalize_images()).needs_seed


def test_for_images_augments_only_training():
    assert not pipelines.for_images(training=False, augment=True).needs_seed
    assert pipelines.for_images(training=True, augment=True).needs_seed
    assert not pipelines.for_images(training=True).needs_seed


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: pipelines.normalize_images(std=0), r"`std` must be positive"),
        (lambda: pipelines.random_crop_flip(padding=-1), r"`padding` must be an integer >= 0"),
        (lambda: pipelines.pad_tokens(length=0), r"`length` must be a positive integer"),
        (lambda: pipelines.decode_image(channels=4), r"`channels` must be 1 or 3"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_non_tensor_features_are_a_clear_error():
    with pytest.raises(TypeError, match=r"normalize_images expects the features"):
        pipelines.normalize_images()({"image": tf.zeros((2, 2, 1))}, 0)
    with pytest.raises(TypeError, match="compose expects callables"):
        pipelines.compose(3)
