"""Does `--model` fit `--dataset`, and what must the input pipeline do first?

This module owns the rules that pair a registered model's declared
`models.InputRequirements` with a `DataDescription` of a dataset: the input
kind (images, features, token ids) and rank, the dtype, the minimum image
size, the number of classes, token padding, and the split names
(`--eval_split`). `check` returns an `InputPlan` (resize the images to
`--image_size`, pad the tokens to `--sequence_length`, the vocabulary the
model is built with) or raises `IncompatibleError`, a `ConfigError` whose one
line names both flags, says what each side has, and gives the fix: a flag to
pass, or the datasets (and models) that fit.

Nothing here is a list of model-dataset pairs: the answers come from the
declarations, so a newly registered model or dataset is covered. It reads no
data and starts no TensorFlow runtime (`tfdp-train` calls it before the
strategy exists, and again once the data is described exactly); the
descriptions are `tfdp.app.data_description`'s, the preprocessing
`tfdp.app.input_plan`'s.
"""

from __future__ import annotations

from tfdp.app import data_description
from tfdp.app.input_plan import InputPlan
from tfdp.app.run_config import ConfigError

#: The evaluation split when `--eval_split` is not given, in order of preference.
DEFAULT_EVAL_SPLITS = ("test", "validation")


class IncompatibleError(ConfigError):
    """The model and the dataset (or a split, or a flag) do not fit; raised before training."""


def check(model: str, data: data_description.DataDescription | None, *,
          image_size: int | None = None, sequence_length: int | None = None,
          num_classes: int | None = None, hints: bool = True) -> InputPlan:
    """Checks that registered `model` can train on `data`; returns what to adapt.

    Args:
        model: a model name; one not registered (`models.names()`) or
            registered without declared inputs passes.
        data: the dataset's description; `None` (not known yet) passes.
        image_size: `--image_size`: resize images to this square size.
        sequence_length: `--sequence_length`: pad or truncate token
            sequences to this many tokens.
        num_classes: `--num_classes`, when given (overrides the dataset's).
        hints: list the datasets and models that fit in the message.
            Defaults to True.

    Returns:
        The `InputPlan`: `resize_to`, `pad_to`, and `model_arguments` (the
        token vocabulary for models that take `vocab_size`).

    Raises:
        IncompatibleError: one line naming `--model` and `--dataset` (or the
            flag at fault), what each has, and the fix.
    """
    from tfdp import models

    # A model built by the caller's own build_model (not registered) declares nothing.
    requirements = models.input_requirements(model) if model in models.names() else None
    if data is None or requirements is None:
        return InputPlan()
    kind = data.kind
    pair = f"--model={model} reads {requirements.describe()}"
    if kind is None:
        return InputPlan()
    if kind not in requirements.kinds:
        fix = "decode them in your own tf.data code (--dataset=python:module:function). " \
            if kind == "encoded" else ""
        raise IncompatibleError(
            f"{pair}, and --dataset={data.name} gives {data.describe()}. {fix}"
            + (_fits(model, data, image_size=image_size) if hints else "").strip())
    if kind != "images" and image_size is not None:
        raise IncompatibleError(
            f"--image_size resizes images, and --dataset={data.name} gives {data.describe()}. "
            f"Drop --image_size.")
    if kind != "tokens" and sequence_length is not None:
        raise IncompatibleError(
            f"--sequence_length pads token sequences, and --dataset={data.name} gives "
            f"{data.describe()}. Drop --sequence_length.")
    classes = num_classes or data.num_classes
    if classes is not None and classes < requirements.min_classes:
        raise IncompatibleError(
            f"--model={model} needs at least {requirements.min_classes} classes (one logit "
            f"each), and --dataset={data.name} has {classes}. Use a dataset with more classes"
            + (" or pass --num_classes." if data.name == "tfrecord" or data.name.startswith(
                "python:") else "."))
    if kind == "images":
        return _fit_images(model, requirements, data, image_size=image_size, hints=hints)
    if kind == "tokens":
        return _fit_tokens(model, data, sequence_length=sequence_length)
    if data.shape is not None and None in data.shape:
        raise IncompatibleError(
            f"{pair}, and --dataset={data.name} gives {data.describe()}, whose size varies "
            f"between examples. Give them one shape in your tf.data code.")
    return InputPlan()


def _fit_images(model, requirements, data, *, image_size, hints) -> InputPlan:
    minimum = requirements.min_image_size
    if image_size is not None:
        if image_size < minimum:
            raise IncompatibleError(
                f"--model={model} needs images of at least {minimum}x{minimum} pixels, and "
                f"--image_size={image_size} makes them {image_size}x{image_size}. Pass "
                f"--image_size={minimum} or more.")
        resize = data.shape is None or tuple(data.shape[:2]) != (image_size, image_size)
        return InputPlan(resize_to=image_size if resize and data.shape is not None else None)
    if data.shape is None:
        return InputPlan()  # size known once the first example is read
    height, width = data.shape[:2]
    if height is None or width is None:
        raise IncompatibleError(
            f"--dataset={data.name} gives {data.describe()} (their size varies) and "
            f"--model={model} needs one size. Pass --image_size=N to resize them "
            f"(N >= {max(minimum, 1)}, e.g. {max(minimum, 224)}).")
    if min(height, width) < minimum:
        others = _models_that_fit(data, exclude=model) if hints else []
        raise IncompatibleError(
            f"--model={model} needs images of at least {minimum}x{minimum} pixels, and "
            f"--dataset={data.name} gives {data.describe()}. Pass --image_size={minimum} "
            f"(resized in the input pipeline)"
            + (f", or a model for {height}x{width} images: --model={'/'.join(others)}."
               if others else "."))
    return InputPlan()


def _fit_tokens(model, data, *, sequence_length) -> InputPlan:
    from tfdp import models

    fixed = data.shape[0] if data.shape else None
    length = sequence_length or fixed or data.max_length
    if length is None:
        raise IncompatibleError(
            f"--model={model} needs token sequences of one length, and --dataset={data.name} "
            f"gives {data.describe()} without saying the longest. Pass --sequence_length=N "
            f"(shorter sequences are padded with id 0, longer ones truncated).")
    arguments = {}
    if data.vocab_size is not None and models.accepts(model, "vocab_size"):
        arguments["vocab_size"] = data.vocab_size
    return InputPlan(pad_to=length if length != fixed else None, model_arguments=arguments)


def _models_that_fit(data, *, exclude: str) -> list[str]:
    from tfdp import models

    fits = []
    for name in models.names():
        if name == exclude:
            continue
        try:
            check(name, data, hints=False)
        except IncompatibleError:
            continue
        fits.append(name)
    return fits


def _fits(model: str, data, *, image_size) -> str:
    """"Datasets that fit: ...; models that fit --dataset=X: ..." for a refusal."""
    from types import SimpleNamespace

    from tfdp import models
    from tfdp import pipelines

    datasets = []
    for name in pipelines.known_sources():
        config = SimpleNamespace(dataset=name, data_dir=None, image_size=None,
                                 image_channels=3, num_classes=None, eval_files=None)
        try:
            other = data_description.describe_before_strategy(config)
        except Exception:  # noqa: BLE001 (a source that cannot be described is not listed)
            continue
        if other is None or other.kind is None:
            continue
        for flags, size in (("", None), ("with --image_size={}", _min_size(model))):
            if size is None and flags:
                continue
            try:
                check(model, other, image_size=size, hints=False)
            except IncompatibleError:
                continue
            datasets.append(name + (f" ({flags.format(size)})" if flags else ""))
            break
    requirements = models.input_requirements(model)
    if "tokens" in requirements.kinds or "features" in requirements.kinds:
        datasets.append("your own (--dataset=python:module:function)")
    elif "images" in requirements.kinds:
        datasets.append("TFDS image datasets, your TFRecord images (--dataset=tfrecord)")
    others = _models_that_fit(data, exclude=model)
    text = f"Datasets that fit --model={model}: {', '.join(datasets)}."
    if others:
        text += f" Models that fit --dataset={data.name}: {', '.join(others)}."
    return text


def _min_size(model: str) -> int | None:
    from tfdp import models

    requirements = models.input_requirements(model)
    return requirements.min_image_size if "images" in requirements.kinds else None


def _split_base(split: str) -> str:
    """`"train[:90%]"` -> `"train"` (TFDS slicing)."""
    return split.split("[", 1)[0].strip()


def check_split(split: str, data: data_description.DataDescription | None, *, flag: str) -> None:
    """Raises `IncompatibleError` if `data` lists its splits and `split` is not one."""
    if data is None or data.splits is None:
        return
    parts = [_split_base(p) for p in split.split("+")]
    missing = [p for p in parts if p not in data.splits]
    if missing:
        raise IncompatibleError(
            f"{flag}={split}: --dataset={data.name} has no split {missing[0]!r}; its splits "
            f"are {', '.join(data.splits)}.")


def eval_split(requested: str | None, data: data_description.DataDescription | None, *,
               flag: str = "--eval_split") -> str:
    """The split to evaluate on: `requested`, else `test`, else `validation`.

    Args:
        requested: `--eval_split`, or `None` for the default.
        data: the dataset's description; with unknown split names (`None`, or
            `splits=None`) the first default is taken.
        flag: the flag that picks the split, for messages (`tfdp-predict`
            says `--split`). Defaults to `"--eval_split"`.

    Raises:
        IncompatibleError: `requested` is not a split of the dataset, or it is
            `None` and the dataset has neither default; the message lists the
            splits.
    """
    if requested is not None:
        check_split(requested, data, flag=flag)
        return requested
    if data is None or data.splits is None:
        return DEFAULT_EVAL_SPLITS[0]
    for split in DEFAULT_EVAL_SPLITS:
        if split in data.splits:
            return split
    raise IncompatibleError(
        f"--dataset={data.name} has no {' or '.join(repr(s) for s in DEFAULT_EVAL_SPLITS)} split "
        f"to evaluate on; its splits are {', '.join(data.splits)}. Pass {flag}=NAME "
        f"(e.g. {flag}={data.splits[-1]})" + (", or --noeval." if flag == "--eval_split" else "."))
