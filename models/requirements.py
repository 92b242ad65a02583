"""What a registered model needs from one example: `InputRequirements`.

This module owns the declaration a model builder registers beside itself
(`models.register(name, inputs=...)`), so a program can tell before it builds
anything (no TensorFlow runtime, no data read) whether a dataset fits the
model and what the input pipeline must do first (resize, pad). It does not
look at datasets: `tfdp.app.compatibility` compares these declarations with a
dataset's description.

The kinds of input, for one example without the batch axis:

- `"images"`: `(height, width, channels)` pixels, uint8 (the pipeline scales
  them to [0, 1] floats) or floats;
- `"features"`: floats (or uint8) of any fixed shape, e.g. a vector;
- `"tokens"`: `(sequence_length,)` integer token ids, 0 for padding.
"""

from __future__ import annotations

import dataclasses

#: The kinds of input a model can declare (see the module docstring).
KINDS = ("images", "features", "tokens")

#: How each kind reads in messages.
KIND_DESCRIPTIONS = {
    "images": "images (height, width, channels)",
    "features": "fixed-shape float features",
    "tokens": "token ids (sequence_length,)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputRequirements:
    """What one example must be for a model to train on it.

    Attributes:
        kinds: the input kinds the model reads, a non-empty subset of `KINDS`.
        min_image_size: the smallest height and width, in pixels, for
            `"images"`. Defaults to 1.
        min_classes: the fewest label classes (logits). Defaults to 2.

    Raises:
        ValueError: `kinds` is empty or holds an unknown kind, or a minimum is
            not a positive integer.

    Example:

    ```python
    @models.register("tiny_cnn", inputs=InputRequirements(kinds=("images",), min_image_size=4))
    def tiny_cnn(*, input_shape, num_classes): ...
    ```
    """

    kinds: tuple[str, ...]
    min_image_size: int = 1
    min_classes: int = 2

    def __post_init__(self):
        kinds = tuple(self.kinds) if not isinstance(self.kinds, str) else (self.kinds,)
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise ValueError(f"`kinds` must be a non-empty subset of {KINDS}. "
                             f"Received: kinds={self.kinds!r}")
        object.__setattr__(self, "kinds", kinds)
        for name in ("min_image_size", "min_classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")

    def describe(self) -> str:
        """E.g. "images (height, width, channels) of at least 32x32"."""
        parts = [KIND_DESCRIPTIONS[k] for k in self.kinds]
        text = " or ".join(parts)
        if "images" in self.kinds and self.min_image_size > 1:
            text += f" of at least {self.min_image_size}x{self.min_image_size} pixels"
        return text


#: Images of any size (the CIFAR ResNets: stride-2 stages round up).
IMAGES = InputRequirements(kinds=("images",))
#: Token ids: the transformer.
TOKENS = InputRequirements(kinds=("tokens",))
#: Anything with a fixed numeric shape, flattened: the MLP.
IMAGES_OR_FEATURES = InputRequirements(kinds=("images", "features"))
