"""models.get / names / register: the registry contract and its errors."""

import keras
import pytest

from tfdp import models
from tfdp.models import registry

DOCUMENTED_MODELS = ["cnn", "mlp", "resnet20", "resnet32", "resnet50", "resnet56", "transformer"]


@pytest.fixture
def scratch_registry(monkeypatch):
    """Lets a test register models without leaking them into other tests."""
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
    monkeypatch.setattr(registry, "_INPUTS", dict(registry._INPUTS))


def _tiny(*, input_shape, num_classes, units=4):
    inputs = keras.Input(input_shape)
    x = keras.layers.Dense(units)(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes, dtype="float32")(x))


def test_public_surface_is_pinned():
    assert models.__all__ == ["accepts", "get", "input_requirements", "InputRequirements",
                              "names", "register"]


def test_accepts_says_which_models_take_remat_and_sync_bn():
    remat = [n for n in models.names() if models.accepts(n, "remat")]
    sync_bn = [n for n in models.names() if models.accepts(n, "sync_bn")]
    assert remat == ["resnet20", "resnet32", "resnet50", "resnet56", "transformer"]
    assert sync_bn == ["resnet20", "resnet32", "resnet50", "resnet56"]
    with pytest.raises(ValueError, match="Unknown model 'alexnet'"):
        models.accepts("alexnet", "remat")


def test_names_are_the_documented_models_sorted():
    assert models.names() == DOCUMENTED_MODELS


def test_unknown_name_lists_the_known_models():
    with pytest.raises(ValueError) as error:
        models.get("alexnet", input_shape=(8, 8, 1), num_classes=10)
    assert str(error.value) == (
        "Unknown model 'alexnet'. Known models: " + ", ".join(DOCUMENTED_MODELS)
        + ". Received: name='alexnet'"
    )


def test_register_as_decorator_then_get(scratch_registry):
    decorated = models.register("tiny")(_tiny)
    assert decorated is _tiny
    assert "tiny" in models.names()
    model = models.get("tiny", input_shape=(3,), num_classes=2, units=5)
    assert model.output_shape == (None, 2)


def test_register_as_call(scratch_registry):
    assert models.register("tiny", _tiny) is _tiny
    assert models.names() == sorted(DOCUMENTED_MODELS + ["tiny"])


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_register_refuses_a_taken_name(scratch_registry, name):
    with pytest.raises(ValueError, match=f"'{name}' is already registered.*another name"):
        models.register(name, _tiny)


@pytest.mark.parametrize("name", ["", " cnn2", "my model", "tab\tname", 3, None])
def test_register_refuses_invalid_names(scratch_registry, name):
    with pytest.raises(ValueError, match="non-empty string without spaces.*Received: name="):
        models.register(name, _tiny)


def test_register_refuses_builders_without_the_required_arguments(scratch_registry):
    def no_classes(*, input_shape):
        return None

    with pytest.raises(ValueError, match="must accept the keyword arguments input_shape "
                                         "and num_classes.*lacks num_classes"):
        models.register("broken", no_classes)
    with pytest.raises(TypeError, match="must be callable"):
        models.register("broken", "not a function")
    assert "broken" not in models.names()


def test_get_rejects_an_argument_the_model_does_not_take():
    with pytest.raises(ValueError) as error:
        models.get("cnn", input_shape=(8, 8, 1), num_classes=10, depth=20)
    message = str(error.value)
    assert "Model 'cnn' does not take the argument(s) depth" in message
    assert "It accepts: input_shape, num_classes, filters, dense_units, dropout" in message
    assert "Received: depth=20" in message


def test_get_names_missing_required_arguments():
    with pytest.raises(ValueError, match="Model 'mlp' needs the keyword argument.*num_classes"):
        models.get("mlp", input_shape=(8, 8, 1))


def test_get_checks_the_logit_width_of_user_models(scratch_registry):
    @models.register("wrong_width")
    def wrong_width(*, input_shape, num_classes):
        return _tiny(input_shape=input_shape, num_classes=num_classes + 1)

    with pytest.raises(ValueError,
                       match=r"shape \(batch, num_classes\) = \(batch, 3\).*\(None, 4\)"):
        models.get("wrong_width", input_shape=(2,), num_classes=3)


def test_get_refuses_builders_that_return_no_model(scratch_registry):
    models.register("not_a_model", lambda *, input_shape, num_classes: "model")
    with pytest.raises(TypeError, match="must return a keras.Model. Received: str"):
        models.get("not_a_model", input_shape=(2,), num_classes=2)


def test_every_registered_model_declares_its_inputs():
    declared = {name: models.input_requirements(name) for name in models.names()}
    assert all(isinstance(r, models.InputRequirements) for r in declared.values()), declared
    assert declared["transformer"].kinds == ("tokens",)
    assert declared["resnet50"].min_image_size == 32
    assert declared["mlp"].kinds == ("images", "features")


def test_register_keeps_declared_inputs_and_refuses_other_values(scratch_registry):
    inputs = models.InputRequirements(kinds=("features",))
    models.register("tiny_declared", _tiny, inputs=inputs)
    assert models.input_requirements("tiny_declared") is inputs
    models.register("tiny_undeclared", _tiny)
    assert models.input_requirements("tiny_undeclared") is None
    with pytest.raises(TypeError, match="must be a models.InputRequirements"):
        models.register("tiny_bad", _tiny, inputs={"kinds": ("features",)})
    with pytest.raises(ValueError, match="non-empty subset"):
        models.InputRequirements(kinds=("pixels",))
