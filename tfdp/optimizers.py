"""Public API: large-batch optimizers for Keras 3, LARS and LAMB.

They live in the training wing (`tfdp.training.optimizers`); this module is
their public name, as `keras.optimizers` is for `keras.src.optimizers`. Both are
registered for serialisation under the `tfdp` package (`"tfdp>LARS"`,
`"tfdp>LAMB"`), so models compiled with them save to `.keras` and load
without `custom_objects`.
"""

from tfdp.training.optimizers._exclusion import DEFAULT_EXCLUDE_PATTERNS
from tfdp.training.optimizers.lamb import LAMB
from tfdp.training.optimizers.lars import LARS

__all__ = ["DEFAULT_EXCLUDE_PATTERNS", "LAMB", "LARS"]
