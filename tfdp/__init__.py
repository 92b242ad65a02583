"""tfdp: data-parallel training of Keras 3 models on TensorFlow.

Public names are imported lazily, on first use, so that light modules such as
`tfdp.distribute.cluster` (which the launcher needs) load without importing TensorFlow.
"""

import importlib as _importlib
import os as _os

# tfdp is a TensorFlow toolkit: Keras must run on the TensorFlow backend.
_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "BatchConfig": "tfdp.training.batch",
    "compile": "tfdp.training.fit_compile",
    "configure_cpu_devices": "tfdp.distribute.devices",
    "make_strategy": "tfdp.distribute.strategy",
    "predict": "tfdp.inference.predict",
    "PredictionSummary": "tfdp.inference.predict",
    "read_predictions": "tfdp.inference.read",
    "scale_lr": "tfdp.training.lr_schedules",
    "strategy_info": "tfdp.distribute.strategy_info",
    "StrategyInfo": "tfdp.distribute.strategy_info",
    "Trainer": "tfdp.training.trainer",
    "WarmupSchedule": "tfdp.training.lr_schedules",
}
_SUBPACKAGES = ("callbacks", "compression", "optimizers")

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES])


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"tfdp.{name}")
    else:
        raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
