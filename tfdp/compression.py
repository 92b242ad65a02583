"""Gradient compression for `tfdp.compile(gradient_compression=...)` and `tfdp.Trainer`.

- `PowerSGD(rank=4, start_step=0, min_compression_ratio=2)`: low-rank
  approximations of the gradient matrices, two small all-reduces per step
  (`tfdp.distribute.powersgd`).
- `TopK(fraction=0.01)`: each replica's largest entries, one all-gather
  (`tfdp.distribute.topk`).

- `Float8()` (or `gradient_compression="float8"`): every value as an 8-bit
  E4M3 float with a per-tensor scale, one all-gather (`tfdp.distribute.float8`).

All keep per-replica error-feedback memory, so what one step leaves out is
sent in later steps. `gradient_compression="bfloat16"` instead sums the
whole gradient in bfloat16 (`tfdp.distribute.reduction`).
"""

from tfdp.distribute.compression import GradientCompressor
from tfdp.distribute.float8 import Float8
from tfdp.distribute.powersgd import PowerSGD
from tfdp.distribute.topk import TopK

__all__ = ["Float8", "GradientCompressor", "PowerSGD", "TopK"]
