"""The model of a finished `tfdp-train` run, for programs that use it (`tfdp-predict`).

This module owns reading a run's `summary.json` and rebuilding its model with
the final weights through `tf.train.Checkpoint` (TensorFlow's own reader,
never pickle). It defines no flags, so tests and other programs can import it
beside `tfdp.app.train`.
"""

from __future__ import annotations

import json
import os
import types

from tfdp.app import user_data


class UsageError(ValueError):
    """Bad flags or files: exit 2 with one line."""


def finished_run(model_dir: str) -> dict:
    """The `summary.json` of the finished `tfdp-train` run in `model_dir`.

    Raises:
        UsageError: there is no finished run there (no summary.json, or no
            checkpoint of the final weights).
    """
    summary_path = os.path.join(model_dir, "summary.json")
    if not os.path.isdir(model_dir):
        raise UsageError(f"--model_dir={model_dir} does not exist. Pass a tfdp-train run's "
                         f"--model_dir.")
    if not os.path.isfile(summary_path):
        raise UsageError(
            f"--model_dir={model_dir} holds no finished tfdp-train run (no summary.json: the "
            f"run was not started there or has not finished). Finish the run first (rerun its "
            f"tfdp-train command), or pass another --model_dir."
        )
    if not os.path.isfile(os.path.join(model_dir, "checkpoint")):
        raise UsageError(
            f"--model_dir={model_dir} has a summary.json but no checkpoint of the final "
            f"weights; it was trained without --model_dir or the checkpoint was removed."
        )
    with open(summary_path) as f:
        summary = json.load(f)
    if "config" not in summary or "model" not in summary["config"]:
        raise UsageError(f"{summary_path} is not a tfdp-train summary (no config.model).")
    return summary


def restore_model(model_dir: str, run_config: dict, strategy, *, data_dir, model_info=None):
    """The run's model with its final weights, built under `strategy.scope()`.

    `model_info` is `summary.json`'s `model` (name, input shape, classes);
    runs older than it are rebuilt from their training data's description.
    """
    import keras
    import tensorflow as tf

    from tfdp import models
    from tfdp import pipelines

    if model_info:
        trained_on = types.SimpleNamespace(
            features=types.SimpleNamespace(shape=tuple(model_info["input_shape"])),
            num_classes=model_info["num_classes"])
    elif run_config["dataset"] == user_data.TFRECORD:
        # The run's own files and decoding; its record count is cached in model_dir.
        options = user_data.train_options(types.SimpleNamespace(**run_config),
                                          count_cache_dir=model_dir)
        try:
            trained_on = options.source().describe("train")
        except ValueError as error:
            raise UsageError(f"The run's --train_files cannot be read to rebuild its model: "
                             f"{error}") from None
    else:
        trained_on = pipelines.describe_source(run_config["dataset"], split="train",
                                               data_dir=data_dir)
    if run_config.get("mixed_precision", "none") != "none":
        keras.config.set_dtype_policy(run_config["mixed_precision"])
    with strategy.scope():
        model = models.get(run_config["model"], input_shape=tuple(trained_on.features.shape),
                           num_classes=trained_on.num_classes,
                           **(model_info or {}).get("arguments", {}))
    checkpoint_path = tf.train.latest_checkpoint(model_dir)
    status = tf.train.Checkpoint(model=model).restore(checkpoint_path)
    try:
        status.expect_partial().assert_existing_objects_matched()
    except AssertionError as error:
        raise UsageError(
            f"The checkpoint {checkpoint_path} does not hold the weights of model "
            f"{run_config['model']!r}: {str(error).splitlines()[0]}"
        ) from None
    return model, checkpoint_path
