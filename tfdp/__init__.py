"""tfdp: data-parallel training of Keras 3 models on TensorFlow."""

import os as _os

# tfdp is a TensorFlow toolkit: Keras must run on the TensorFlow backend.
_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from tfdp.accumulation import compile  # noqa: E402  pylint: disable=redefined-builtin
from tfdp.batch import BatchConfig  # noqa: E402
from tfdp.strategy import configure_cpu_devices  # noqa: E402
from tfdp.strategy import make_strategy  # noqa: E402
from tfdp.strategy import strategy_info  # noqa: E402
from tfdp.strategy import StrategyInfo  # noqa: E402

__all__ = [
    "BatchConfig",
    "compile",
    "configure_cpu_devices",
    "make_strategy",
    "strategy_info",
    "StrategyInfo",
]

__version__ = "0.1.0"
