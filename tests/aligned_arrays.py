"""NumPy arrays that TensorFlow converts to tensors without a copy.

TensorFlow shares a NumPy array's memory when the data starts on a 64-byte
boundary and copies it otherwise; tests of what a step does to the caller's
arrays need the shared case every time.
"""

import numpy as np


def aligned_ones(shape) -> np.ndarray:
    """A float32 array of ones of `shape` whose data starts on a 64-byte boundary."""
    size = int(np.prod(shape))
    raw = np.empty(size + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    array = raw[start:start + size].reshape(shape)
    array[:] = 1.0
    return array
