"""Does a dataset fit a model? Checked before the first step, not in it.

This module owns `check_model_compatible`: it compares the example structure
a `make_dataset` pipeline produces (`PipelineInfo.element_spec`,
`num_classes`) with a built Keras model's inputs and output, and raises an
error that names both shapes and the fix, instead of a shape error from deep
inside the first traced training step (possibly on one worker only).
Nothing calls it automatically (`tfdp` never imports `pipelines`): a program
(such as the `tfdp-train` entry point) calls it once per dataset, after
`make_dataset` and building the model, before the first step.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.pipelines.pipeline_info import PipelineInfo


def _info(dataset_or_info) -> PipelineInfo:
    if isinstance(dataset_or_info, PipelineInfo):
        return dataset_or_info
    info = getattr(dataset_or_info, "pipeline_info", None)
    if not isinstance(info, PipelineInfo):
        raise TypeError(
            "`dataset` must be a dataset returned by pipelines.make_dataset (or "
            f"its pipeline_info). Received: {dataset_or_info!r}"
        )
    return info


def _compatible(spec_shape: tf.TensorShape, model_shape) -> bool:
    model_shape = tuple(model_shape)[1:]  # Drop the batch dimension.
    if len(model_shape) != spec_shape.rank:
        return False
    return all(m is None or m == d for m, d in zip(model_shape, spec_shape.as_list()))


def check_model_compatible(dataset_or_info, model) -> None:
    """Raises if the dataset's examples do not fit `model`'s inputs/outputs.

    When to call it: once per dataset, after `make_dataset` returned it and
    the model is built (a functional or `Sequential` model with a
    `keras.Input` is built on construction), and before the first `fit`,
    `evaluate`, `predict` or `tfdp.Trainer` step; call it on every worker.
    It reads only the pipeline's metadata and the model's symbolic shapes
    (no data, no step, no collective), so a mismatch stops every worker
    before training starts instead of failing one worker inside a traced
    step while the others wait in an all-reduce. Nothing calls it for you.

    Checks, when the model is built: one input per feature tensor (matched
    by name for dict features), each with a compatible shape (batch
    dimension excluded); and, for a classification source with a known
    class count and a model with one rank-2 output, that the output width is
    the class count (or 1 for binary). A model that is not built yet (a
    subclassed model before its first call) is not checked.

    Args:
        dataset_or_info: a dataset from `make_dataset`, or its `pipeline_info`.
        model: a `keras.Model`.

    Raises:
        ValueError: a mismatch; the message names the source's and the
            model's shapes.
        TypeError: `dataset_or_info` did not come from `make_dataset`.

    Example:

    >>> train = pipelines.make_dataset("digits", strategy=strategy,  # doctest: +SKIP
    ...                                global_batch=64)
    >>> with strategy.scope():                                       # doctest: +SKIP
    ...     model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
    ...                               keras.layers.Dense(10)])
    >>> pipelines.check_model_compatible(train, model)               # doctest: +SKIP
    >>> model.fit(train)                                             # doctest: +SKIP
    """
    info = _info(dataset_or_info)
    try:
        inputs = model.inputs
        outputs = model.outputs
    except (AttributeError, ValueError):
        return
    if not inputs:
        return
    features, _ = info.element_spec
    where = f"make_dataset(source={info.source!r}, split={info.split!r})"
    if isinstance(features, dict):
        by_name = {t.name.split(":")[0]: t for t in inputs}
        for key, spec in features.items():
            if key not in by_name:
                raise ValueError(
                    f"{where} gives feature {key!r} but the model has no input "
                    f"named {key!r} (inputs: {sorted(by_name)}). Name the "
                    f"model's keras.Input(name={key!r}) accordingly."
                )
            if not _compatible(spec.shape, by_name[key].shape):
                raise ValueError(
                    f"{where} gives feature {key!r} of shape {tuple(spec.shape)}, "
                    f"but the model's input {key!r} expects {tuple(by_name[key].shape)} "
                    f"(batch first). Resize in `preprocess` or change the input."
                )
    else:
        flat = tf.nest.flatten(features)
        if len(flat) != len(inputs):
            raise ValueError(
                f"{where} gives {len(flat)} feature tensor(s) per example, but "
                f"the model has {len(inputs)} input(s)."
            )
        for spec, model_input in zip(flat, inputs):
            if not _compatible(spec.shape, model_input.shape):
                raise ValueError(
                    f"{where} gives features of shape {tuple(spec.shape)} "
                    f"({spec.dtype.name}), but the model expects input shape "
                    f"{tuple(model_input.shape)} (batch first). Build the model "
                    f"with keras.Input(shape={tuple(spec.shape)}) or resize in "
                    f"`preprocess`."
                )
    if info.num_classes and outputs and len(outputs) == 1 and len(outputs[0].shape) == 2:
        width = outputs[0].shape[-1]
        if width not in (None, info.num_classes) and not (width == 1 and info.num_classes == 2):
            raise ValueError(
                f"{where} has {info.num_classes} classes, but the model's output "
                f"has {width} unit(s). Build the classifier head with "
                f"{info.num_classes} units."
            )
