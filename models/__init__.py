"""Keras models for tfdp, by name: `tfdp.models.get("cnn", input_shape=..., num_classes=...)`.

Every model maps one batch of examples to float32 logits of shape
`(batch, num_classes)` (train it with
`SparseCategoricalCrossentropy(from_logits=True)`), also under the
`mixed_float16` and `mixed_bfloat16` dtype policies. Registered models:

- `mlp`: flattens any input; `cnn`: small CNN for 8x8 digits and MNIST.
- `resnet20`, `resnet32`, `resnet56`: CIFAR ResNets v1 (He et al., 2016).
- `resnet50`: `keras.applications.ResNet50`, random weights, >= 32x32 input.
- `transformer`: encoder classifier over int token ids `(batch, seq_len)`.

`remat=True` (the transformer, the ResNets) recomputes each block's
activations in the backward pass (`tfdp.models.remat`); `sync_bn=True` (the
ResNets) synchronises batch normalisation statistics over the global batch.

Each declares what one example must be (`input_requirements(name)`: images of
a minimum size, fixed-shape features, or token ids), so `tfdp-train` checks a
dataset against a model before building anything. Register your own with
`@tfdp.models.register("name", inputs=InputRequirements(...))`. The library never
imports this package: `tfdp-train` (`tfdp.app`) passes `models.get` to
`tfdp.app.experiment`.
"""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from tfdp.models.registry import accepts  # noqa: E402
from tfdp.models.registry import get  # noqa: E402
from tfdp.models.registry import input_requirements  # noqa: E402
from tfdp.models.registry import names  # noqa: E402
from tfdp.models.registry import register  # noqa: E402
from tfdp.models.requirements import InputRequirements  # noqa: E402

# Importing the family modules registers their builders.
from tfdp.models import cnn as _cnn  # noqa: E402, F401
from tfdp.models import mlp as _mlp  # noqa: E402, F401
from tfdp.models import resnet50 as _resnet50  # noqa: E402, F401
from tfdp.models import resnet_cifar as _resnet_cifar  # noqa: E402, F401
from tfdp.models import transformer as _transformer  # noqa: E402, F401

__all__ = [
    "accepts",
    "get",
    "input_requirements",
    "InputRequirements",
    "names",
    "register",
]
