"""Large-batch optimizers for Keras 3: LARS and LAMB.

Both are `keras.optimizers.Optimizer` subclasses registered for serialisation
under the `tfdp` package (`"tfdp>LARS"`, `"tfdp>LAMB"`), so models compiled
with them save to `.keras` and load without `custom_objects`.
"""

from tfdp.optimizers._exclusion import DEFAULT_EXCLUDE_PATTERNS
from tfdp.optimizers.lamb import LAMB
from tfdp.optimizers.lars import LARS

__all__ = ["DEFAULT_EXCLUDE_PATTERNS", "LAMB", "LARS"]
