"""Compressors in optimizer configs: `serialize` and `deserialize` by class name.

Kept apart from `compression.py` (the base class) because it needs every
compressor class, and they import the base.
"""

from __future__ import annotations

from tfdp.distribute import powersgd
from tfdp.distribute import topk
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
    classes = {"PowerSGD": powersgd.PowerSGD, "TopK": topk.TopK}
    if config.get("class_name") not in classes:
        raise ValueError(f"Unknown gradient compressor {config.get('class_name')!r}; "
                         f"known: {sorted(classes)}.")
    return classes[config["class_name"]].from_config(config["config"])

