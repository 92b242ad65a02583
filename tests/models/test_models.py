"""Every registered model: logits shape and dtype (also under mixed precision),
argument errors, serialisation and reproducible initialisation."""

import keras
import numpy as np
import pytest

from tfdp import models

BATCH, CLASSES = 2, 3

#: Each model at a tiny size: (input_shape, extra keyword arguments).
TINY = {
    "mlp": ((8, 8, 1), dict(hidden_units=(8,))),
    "cnn": ((8, 8, 1), dict(filters=(4, 8), dense_units=8)),
    "resnet20": ((8, 8, 3), {}),
    "resnet32": ((8, 8, 3), {}),
    "resnet56": ((8, 8, 3), {}),
    "transformer": ((6,), dict(vocab_size=50, num_layers=1, num_heads=2, hidden=8)),
}


def _inputs(name, input_shape, batch=BATCH):
    rng = np.random.default_rng(0)
    if name == "transformer":
        return rng.integers(1, 50, size=(batch, *input_shape)).astype("int32")
    return rng.uniform(size=(batch, *input_shape)).astype("float32")


def _build(name, num_classes=CLASSES):
    input_shape, kwargs = TINY[name]
    return models.get(name, input_shape=input_shape, num_classes=num_classes, **kwargs)


@pytest.fixture(params=["float32", "mixed_bfloat16", "mixed_float16"])
def dtype_policy(request):
    """Sets a global dtype policy for one test, and always restores float32."""
    keras.config.set_dtype_policy(request.param)
    try:
        yield request.param
    finally:
        keras.config.set_dtype_policy("float32")


def test_every_registered_model_has_a_tiny_test_configuration():
    assert sorted(TINY) == [n for n in models.names() if n != "resnet50"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_logits_are_float32_batch_by_classes(name, dtype_policy):
    model = _build(name)
    assert model.output_shape == (None, CLASSES)
    logits = model(_inputs(name, TINY[name][0]), training=False)
    assert tuple(logits.shape) == (BATCH, CLASSES)
    assert logits.dtype == "float32"
    assert np.all(np.isfinite(np.asarray(logits)))
    if dtype_policy != "float32":  # The body really computes in low precision.
        compute_dtypes = {layer.compute_dtype for layer in model.layers}
        assert dtype_policy.removeprefix("mixed_") in compute_dtypes


@pytest.mark.slow
def test_resnet50_builds_without_downloading_and_outputs_float32_logits():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = models.get("resnet50", input_shape=(32, 32, 3), num_classes=3)
        logits = model(_inputs("resnet50", (32, 32, 3)), training=False)
    finally:
        keras.config.set_dtype_policy("float32")
    assert model.output_shape == (None, 3)
    assert tuple(logits.shape) == (BATCH, 3) and logits.dtype == "float32"
    assert 23_000_000 < model.count_params() < 24_000_000


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("resnet50", dict(input_shape=(8, 8, 1)), r"height and width >= 32.*Received: "
         r"input_shape=\(8, 8, 1\).*Resize the images"),
        ("cnn", dict(input_shape=(64,)), r"must have 3 dimension\(s\) \(height, width, "
         r"channels\).*Received: input_shape=\(64,\).*'mlp'"),
        ("cnn", dict(input_shape=(1, 1, 1)), r"height and width >= 2"),
        ("resnet20", dict(input_shape=(32, 32)), r"must have 3 dimension\(s\)"),
        ("transformer", dict(input_shape=(8, 8, 1)), r"must have 1 dimension\(s\) "
         r"\(sequence_length,\)"),
        ("transformer", dict(input_shape=(None,)), r"tuple of positive integers.*pad or resize"),
        ("mlp", dict(input_shape=(0, 3)), r"tuple of positive integers"),
        ("mlp", dict(input_shape=8), r"tuple of positive integers.*Received: input_shape=8"),
        ("mlp", dict(num_classes=1), r"`num_classes` of model 'mlp' must be an integer >= 2"
         r".*Received: num_classes=1"),
        ("mlp", dict(hidden_units=64), r"`hidden_units`.*list or tuple.*Received: hidden_units=64"),
        ("cnn", dict(filters=()), r"`filters` of model 'cnn' must be a non-empty list"),
        ("cnn", dict(dropout=1.0), r"`dropout` of model 'cnn' must be a number in \[0, 1\)"),
        ("cnn", dict(dense_units=0), r"`dense_units` of model 'cnn' must be an integer >= 1"),
        ("resnet32", dict(batch_norm_momentum=1.5), r"`batch_norm_momentum`"),
        ("transformer", dict(hidden=10, num_heads=4), r"`num_heads` of model 'transformer' "
         r"must divide `hidden`.*num_heads=4, hidden=10.*\[1, 2\]"),
        ("transformer", dict(vocab_size=0), r"`vocab_size`.*>= 1"),
        ("transformer", dict(norm_first="yes"), r"`norm_first`.*True \(pre-LN\)"),
    ],
)
def test_invalid_arguments_name_the_problem_and_the_fix(name, kwargs, message):
    arguments = dict(input_shape=(8, 8, 1) if name != "transformer" else (6,), num_classes=10)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        models.get(name, **arguments)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet20", "transformer"])
def test_json_round_trip_gives_the_same_function(name):
    model = _build(name)
    restored = keras.models.model_from_json(model.to_json())
    restored.set_weights(model.get_weights())
    x = _inputs(name, TINY[name][0])
    np.testing.assert_allclose(restored(x, training=False), model(x, training=False), rtol=1e-6)
    assert restored.name == model.name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "resnet20", "transformer"])
def test_the_seed_fixes_the_initial_weights(name):
    def weights(seed):
        keras.utils.set_random_seed(seed)
        return _build(name).get_weights()

    first, again, other = weights(3), weights(3), weights(4)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, c) for a, c in zip(first, other))
