"""Compressors in optimizer configs: `serialize` and `deserialize` by class name.

Kept apart from `compression.py` (the base class) because it imports every
compressor module, so that each has registered its class.
"""

from __future__ import annotations

from tfdp.distribute import compression
from tfdp.distribute import float8  # noqa: F401  (registers Float8)
from tfdp.distribute import powersgd  # noqa: F401  (registers PowerSGD)
from tfdp.distribute import topk  # noqa: F401  (registers TopK)
from tfdp.distribute.compression import GradientCompressor


def serialize(compressor: GradientCompressor | None) -> dict | None:
    """A JSON-able description of `compressor` (for optimizer configs)."""
    if compressor is None:
        return None
    return {"class_name": type(compressor).__name__, "config": compressor.get_config()}


def deserialize(config: dict | None) -> GradientCompressor | None:
    """The compressor `serialize` described."""
    if config is None:
        return None
    classes = compression.REGISTERED
    if config.get("class_name") not in classes:
        raise ValueError(f"Unknown gradient compressor {config.get('class_name')!r}; "
                         f"known: {sorted(classes)}.")
    return classes[config["class_name"]].from_config(config["config"])

