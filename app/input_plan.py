"""What the input pipeline does so a dataset's examples fit the model: `InputPlan`.

This module owns turning the plan `tfdp.app.compatibility.check` returns
(resize images to `--image_size`, pad token sequences to
`--sequence_length`, the vocabulary the model is built with) into the
per-example `preprocess` of `pipelines.make_dataset`, the same for
`tfdp-train` (training and evaluation) and `tfdp-predict` (scoring). It
decides nothing: the checks are `tfdp.app.compatibility`'s.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """How a dataset's examples are adapted to a model.

    Attributes:
        resize_to: resize images to `resize_to` x `resize_to` pixels
            (bilinear, after scaling uint8 pixels to [0, 1]), or `None`.
        pad_to: pad token sequences with id 0 (or truncate them) to this many
            tokens, or `None` when they already have the model's length.
        model_arguments: extra keyword arguments of the model builder that
            follow from the data, e.g. `{"vocab_size": 1000}`.
    """

    resize_to: int | None = None
    pad_to: int | None = None
    model_arguments: dict = dataclasses.field(default_factory=dict)

    def preprocess(self, features_spec, *, training: bool):
        """The `make_dataset(preprocess=...)` for examples whose features are `features_spec`.

        uint8 images are scaled to [0, 1] floats (`pipelines.for_images`), then
        resized; token ids are cast to int32 and padded or truncated. Other
        features pass through unchanged.

        Args:
            features_spec: the source's `tf.TensorSpec` of one example's
                features, before preprocessing.
            training: whether this is the training split.

        Returns:
            A preprocess callable, or `None` when there is nothing to do.
        """
        import tensorflow as tf

        from tfdp import pipelines

        dtype = getattr(features_spec, "dtype", None)
        steps = []
        if dtype is not None and dtype == tf.uint8:
            steps.append(pipelines.for_images(training=training))
        if self.resize_to is not None:
            steps.append(_Resize(self.resize_to))
        if self.pad_to is not None:
            if dtype is not None and dtype != tf.int32:
                steps.append(_CastTokens())
            steps.append(pipelines.pad_tokens(length=self.pad_to))
        if not steps:
            return None
        return steps[0] if len(steps) == 1 else pipelines.compose(*steps)


class _Resize:
    """Resizes `(height, width, channels)` images to `size` x `size` (bilinear)."""

    needs_seed = False

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image, label):
        import tensorflow as tf

        resized = tf.image.resize(image, (self.size, self.size))
        return tf.cast(resized, image.dtype) if image.dtype.is_floating else resized, label

    def __repr__(self):
        return f"resize(size={self.size})"


class _CastTokens:
    """Token ids to int32, the transformer's input dtype."""

    needs_seed = False

    def __call__(self, tokens, label):
        import tensorflow as tf

        return tf.cast(tokens, tf.int32), label

    def __repr__(self):
        return "cast_tokens(int32)"
