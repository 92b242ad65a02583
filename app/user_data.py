"""The user's own data on the command line: `--dataset=tfrecord` and its flags.

This module owns the file-input options the applications share
(`tfdp-train --train_files/--eval_files`, `tfdp-predict --files`): their
rules, checked before anything starts, and the `pipelines.TFRecordSource`
they describe. Registered names (digits, TFDS, synthetic) pass through as
names.
"""

from __future__ import annotations

import dataclasses
import os
import sys

#: The --dataset value that reads the user's TFRecord files.
TFRECORD = "tfrecord"
#: The --dataset prefix of the user's own tf.data code: python:package.module:function.
PYTHON_PREFIX = "python:"


class UserDataError(ValueError):
    """A file-input flag is missing, stray or invalid."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TFRecordOptions:
    """What `--dataset=tfrecord` reads.

    Attributes:
        files: split -> comma-separated globs, e.g. `{"train": "data/train-*"}`.
        image_key: feature with the encoded image (JPEG/PNG).
        label_key: int64 feature with the class; None for unlabelled records.
        image_size: resize every image to this square size; None keeps the
            first record's size.
        image_channels: channels images are decoded to (1, 3 or 4).
        num_classes: label classes; None reads the largest label once.
        num_examples: split -> example count, when known (skips the counting
            pass for that split).
        count_cache_dir: where the counting pass is cached (None: beside the
            files).
    """

    files: dict
    image_key: str = "image/encoded"
    label_key: str | None = "image/class/label"
    image_size: int | None = None
    image_channels: int = 3
    num_classes: int | None = None
    num_examples: dict = dataclasses.field(default_factory=dict)
    count_cache_dir: str | None = None

    def __post_init__(self):
        if self.image_size is not None and (isinstance(self.image_size, bool)
                                            or self.image_size < 1):
            raise UserDataError(f"--image_size must be a positive number of pixels. "
                                f"Received: --image_size={self.image_size!r}")
        if self.image_channels not in (1, 3, 4):
            raise UserDataError(f"--image_channels must be 1, 3 or 4. Received: "
                                f"--image_channels={self.image_channels!r}")
        if self.num_classes is not None and self.num_classes < 2:
            raise UserDataError(f"--num_classes must be at least 2. Received: "
                                f"--num_classes={self.num_classes!r}")
        for split, count in self.num_examples.items():
            if count is not None and count < 1:
                raise UserDataError(f"The example count of the {split} files must be positive. "
                                    f"Received: {count!r}")

    def source(self):
        """The `pipelines.TFRecordSource` these options describe."""
        from tfdp import pipelines

        size = None if self.image_size is None else (self.image_size, self.image_size)
        return pipelines.TFRecordSource(
            files=self.files, image_key=self.image_key, label_key=self.label_key,
            image_size=size, channels=self.image_channels, num_classes=self.num_classes,
            num_examples={k: v for k, v in self.num_examples.items() if v is not None},
            count_cache_dir=self.count_cache_dir,
        )


#: tfdp-train's file-input flags (only with --dataset=tfrecord).
TRAIN_FLAGS = ("train_files", "eval_files", "image_key", "label_key", "image_size",
               "image_channels", "num_classes", "train_examples")


def check_train_flags(dataset: str, values: dict, *, evaluate: bool) -> None:
    """tfdp-train's rules for its file-input flags; `values` maps flag -> value.

    Raises:
        UserDataError: naming the flag and the fix.
    """
    defaults = {"image_key": "image/encoded", "label_key": "image/class/label",
                "image_channels": 3}
    if dataset != TFRECORD:
        # --image_size resizes any images (tfdp.app.compatibility checks the kind).
        allowed = ("image_size", "num_classes") if dataset.startswith(PYTHON_PREFIX) else (
            "image_size",)
        stray = [f"--{name}" for name in TRAIN_FLAGS
                 if name not in allowed and values.get(name) not in (None, defaults.get(name))]
        if stray:
            raise UserDataError(f"{', '.join(stray)} only apply to --dataset=tfrecord. "
                                f"Received: --dataset={dataset}")
        return
    if not values.get("train_files"):
        raise UserDataError("--dataset=tfrecord needs --train_files (a glob of TFRecord files "
                            "of tf.train.Example records, e.g. 'data/train-*.tfrecord').")
    if evaluate and not values.get("eval_files"):
        raise UserDataError("--dataset=tfrecord with --eval needs --eval_files (the files to "
                            "evaluate on); pass them, or --noeval.")
    if not values.get("label_key"):
        raise UserDataError("--label_key must name the records' int64 class feature for "
                            "training.")


def train_options(config, *, count_cache_dir: str | None) -> TFRecordOptions:
    """The `TFRecordOptions` of a `tfdp-train` run config (`--dataset=tfrecord`)."""
    files = {"train": config.train_files}
    if config.eval_files:
        files["test"] = config.eval_files
    return TFRecordOptions(
        files=files, image_key=config.image_key, label_key=config.label_key,
        image_size=config.image_size, image_channels=config.image_channels,
        num_classes=config.num_classes, num_examples={"train": config.train_examples},
        count_cache_dir=count_cache_dir,
    )


def python_function(dataset: str):
    """The function `--dataset=python:package.module:function` names, imported.

    Importing runs the module's top level only; the function is called later,
    once the strategy exists (a dataset made before MultiWorkerMirroredStrategy
    starts would start TensorFlow's runtime too early).

    Raises:
        UserDataError: malformed value, module not importable, no such callable.
    """
    import importlib

    spec = dataset[len(PYTHON_PREFIX):]
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise UserDataError(
            f"--dataset={dataset!r}: write python:package.module:function, e.g. "
            f"--dataset=python:my_data:train_source (the module must be importable: on "
            f"PYTHONPATH, or in the working directory)."
        )
    # As `python -m` does: modules in the working directory import (a console
    # script's sys.path does not have it).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UserDataError(f"--dataset={dataset!r}: cannot import {module_name!r} ({error}). "
                            f"Put it on PYTHONPATH or run from its directory.") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserDataError(f"--dataset={dataset!r}: {module_name} has no function "
                            f"{function_name!r}.")
    return function


def python_source(dataset: str):
    """The `pipelines` source `--dataset=python:...` gives.

    The function either takes no argument and returns a `pipelines.Source`
    (every split it has: `"train"`, and `"test"` for `--eval`) or a
    `tf.data.Dataset` of `(features, label)` examples (one split, "train"),
    or takes an `input_context` and returns that input pipeline's dataset,
    as `strategy.distribute_datasets_from_function`'s `dataset_fn` does.
    """
    import inspect

    from tfdp import pipelines

    function = python_function(dataset)
    try:
        takes_context = bool(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        takes_context = False
    if takes_context:
        return pipelines.get_source(function)
    result = function()
    if isinstance(result, pipelines.Source):
        return result
    try:
        return pipelines.get_source(result)
    except TypeError:
        raise UserDataError(
            f"--dataset={dataset!r} returned a {type(result).__name__}; it must return a "
            f"pipelines.Source or a tf.data.Dataset of (features, label) examples, or take "
            f"an input_context and return a dataset."
        ) from None
