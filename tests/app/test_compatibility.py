"""Every registered model x every registered dataset: it fits, or it is refused up front.

`tfdp.app.compatibility.check` on the datasets' static descriptions (no
TensorFlow runtime), its refusals through `tfdp-train` (exit 2, one line, both
flags, before any strategy), and what it plans (resize, padding, vocabulary).
The 2-step runs are in test_train_matrix.py; that describing and checking
start no TensorFlow runtime is tested in a fresh process by tests/test_readme.py.
"""

import pytest

from tfdp import models
from tfdp import pipelines
from tfdp.app import compatibility
from tfdp.app import data_description
from tfdp.app import run_config
from tfdp.app import train as train_cli

#: Built-in models that fit each built-in dataset as it is; the others are
#: refused (resnet50 on digits until --image_size=32).
FITS = {
    "digits": {"cnn", "mlp", "resnet20", "resnet32", "resnet56"},
    "synthetic_images": {"cnn", "mlp", "resnet20", "resnet32", "resnet56", "resnet50"},
    "synthetic_tokens": {"transformer"},
}
PAIRS = [(model, dataset) for dataset in pipelines.known_sources() for model in models.names()]


def _describe(dataset, **flags_):
    return data_description.describe_before_strategy(run_config.RunConfig(dataset=dataset,
                                                                          **flags_))


def test_the_registered_datasets_are_described_from_their_metadata():
    described = {name: _describe(name) for name in pipelines.known_sources()}
    assert set(FITS) == set(described), "a registered dataset is missing from FITS"
    assert described["digits"].shape == (8, 8, 1) and described["digits"].kind == "images"
    assert described["digits"].num_classes == 10
    assert described["synthetic_images"].describe() == "32x32x3 uint8 images"
    assert described["synthetic_tokens"].kind == "tokens"
    assert described["synthetic_tokens"].max_length == 64


@pytest.mark.parametrize("model, dataset", PAIRS)
def test_every_pair_fits_or_is_refused_naming_both_flags(model, dataset):
    data = _describe(dataset)
    if model in FITS[dataset]:
        plan = compatibility.check(model, data)
        if dataset == "synthetic_tokens":  # padded to the longest, the model's vocabulary
            assert plan.pad_to == 64 and plan.model_arguments == {"vocab_size": 1000}
        else:
            assert plan.resize_to is None and plan.pad_to is None
        return
    with pytest.raises(compatibility.IncompatibleError) as error:
        compatibility.check(model, data)
    message = str(error.value)
    assert "\n" not in message
    assert f"--model={model}" in message and f"--dataset={dataset}" in message
    if models.input_requirements(model).kinds == ("tokens",):
        assert "Datasets that fit --model=transformer: synthetic_tokens" in message
    if dataset == "synthetic_tokens":
        assert "Models that fit --dataset=synthetic_tokens: transformer." in message


def test_image_size_makes_resnet50_fit_the_digits():
    digits = _describe("digits")
    with pytest.raises(compatibility.IncompatibleError, match="Pass --image_size=32"):
        compatibility.check("resnet50", digits)
    assert compatibility.check("resnet50", digits, image_size=32).resize_to == 32
    assert compatibility.check("cnn", digits, image_size=8).resize_to is None
    with pytest.raises(compatibility.IncompatibleError, match="--image_size=16 makes them 16x16"):
        compatibility.check("resnet50", digits, image_size=16)
    # Refused datasets name the flag that makes them fit.
    with pytest.raises(compatibility.IncompatibleError,
                       match=r"Datasets that fit --model=resnet50: digits \(with "
                             r"--image_size=32\), synthetic_images"):
        compatibility.check("resnet50", _describe("synthetic_tokens"))


def test_sequence_length_pads_or_truncates_and_other_kinds_refuse_the_size_flags():
    tokens = _describe("synthetic_tokens")
    assert compatibility.check("transformer", tokens, sequence_length=16).pad_to == 16
    without_longest = data_description.DataDescription(
        name="python:mine:tokens", shape=(None,), dtype="int64", num_classes=3)
    with pytest.raises(compatibility.IncompatibleError, match="Pass --sequence_length=N"):
        compatibility.check("transformer", without_longest)
    plan = compatibility.check("transformer", without_longest, sequence_length=8)
    assert plan.pad_to == 8 and plan.model_arguments == {}  # vocabulary unknown: the default
    with pytest.raises(compatibility.IncompatibleError, match="Drop --image_size"):
        compatibility.check("transformer", tokens, image_size=32)
    with pytest.raises(compatibility.IncompatibleError, match="Drop --sequence_length"):
        compatibility.check("cnn", _describe("digits"), sequence_length=8)


@pytest.mark.parametrize("data, message", [
    (data_description.DataDescription(name="imagenet2012", shape=(None, None, 3),
                                      dtype="uint8", num_classes=1000),
     "their size varies) and --model=cnn needs one size. Pass --image_size=N"),
    (data_description.DataDescription(name="imdb_reviews", shape=(), dtype="string",
                                      num_classes=2),
     "gives strings (encoded images or text, not decoded). decode them"),
    (data_description.DataDescription(name="python:m:f", shape=(8, 8, 1), dtype="float32",
                                      num_classes=1),
     "needs at least 2 classes (one logit each), and --dataset=python:m:f has 1"),
])
def test_what_no_model_can_read_is_refused_with_the_fix(data, message):
    with pytest.raises(compatibility.IncompatibleError) as error:
        compatibility.check("cnn", data)
    assert message in str(error.value)


def test_undeclared_models_and_undescribed_data_pass_to_the_later_check():
    assert compatibility.check("cnn", None) == compatibility.InputPlan()
    # Your TFRecord images without --image_size: their size is read after the strategy.
    tfrecord = _describe("tfrecord", train_files="x", eval=False)
    assert tfrecord.shape is None and tfrecord.kind == "images"
    assert compatibility.check("resnet50", tfrecord) == compatibility.InputPlan()
    with pytest.raises(compatibility.IncompatibleError, match="--model=transformer reads token"):
        compatibility.check("transformer", tfrecord)


@pytest.mark.parametrize("requested, splits, expected", [
    (None, ("test", "train"), "test"),
    (None, ("train", "validation"), "validation"),
    (None, None, "test"),  # any split name (synthetic)
    ("train[:10%]", ("test", "train"), "train[:10%]"),
    ("validation", None, "validation"),
])
def test_eval_split_is_test_else_validation_else_the_one_asked_for(requested, splits, expected):
    data = data_description.DataDescription(name="d", shape=(4,), dtype="float32",
                                            num_classes=2, splits=splits)
    assert compatibility.eval_split(requested, data) == expected


def test_eval_split_refusals_list_the_available_splits():
    data = data_description.DataDescription(name="d", shape=(4,), dtype="float32",
                                            num_classes=2, splits=("dev", "train"))
    with pytest.raises(compatibility.IncompatibleError,
                       match="no 'test' or 'validation' split to evaluate on; its splits are "
                             "dev, train. Pass --eval_split=NAME"):
        compatibility.eval_split(None, data)
    with pytest.raises(compatibility.IncompatibleError,
                       match="--eval_split=tset: --dataset=d has no split 'tset'; its splits "
                             "are dev, train"):
        compatibility.eval_split("tset", data)


@pytest.mark.parametrize("argv, message", [
    (["--model=resnet50"], "--model=resnet50 needs images of at least 32x32 pixels, and "
                           "--dataset=digits gives 8x8x1 uint8 images. Pass --image_size=32"),
    (["--model=transformer"], "--model=transformer reads token ids"),
    (["--model=cnn", "--dataset=synthetic_tokens"], "Models that fit --dataset=synthetic_tokens"),
    (["--eval_split=validation"], "--eval_split=validation: --dataset=digits has no split"),
    (["--noeval", "--eval_split=test"], "--eval_split=test has nothing to pick with --noeval"),
    (["--image_size=0"], "--image_size must be an integer >= 1 (pixels)"),
    (["--model=transformer", "--dataset=synthetic_tokens", "--image_size=32"],
     "Drop --image_size"),
    (["--dataset=mnist", "--data_dir={tmp}"], "TFDS dataset 'mnist' is not prepared"),
])
def test_misfits_exit_2_with_one_line_before_the_strategy(parse_flags, capsys, monkeypatch,
                                                          tmp_path, argv, message):
    from tfdp.distribute import strategy as strategy_lib

    def no_strategy(*args, **kwargs):
        raise AssertionError("the strategy was built before the refusal")

    monkeypatch.setattr(strategy_lib, "make_strategy", no_strategy)
    parse_flags(*(a.format(tmp=tmp_path) for a in argv))
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["tfdp-train"])
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1, err_lines
    assert err_lines[0].startswith("tfdp-train: error: ") and message in err_lines[0]
