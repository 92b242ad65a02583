"""How a tfdp command-line program logs on each worker process.

The chief logs tfdp's own progress; other workers log only what goes wrong,
and TensorFlow's and TFDS' INFO chatter is dropped everywhere. Shared by
`tfdp-train` and `tfdp-predict`.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys

from absl import logging

from tfdp.distribute import cluster as cluster_lib


#: Packages whose INFO logs the chief shows (progress, resume, data accounting).
_OWN_PACKAGES = ("tfdp", "tfdp.app", "tfdp.launch", "tfdp.models", "tfdp.pipelines")


class _OwnInfoOnly(py_logging.Filter):
    """Passes warnings from anywhere, and INFO only from tfdp's own packages."""

    def __init__(self):
        super().__init__()
        roots = []
        for name in _OWN_PACKAGES:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "__file__", None):
                roots.append(os.path.dirname(module.__file__) + os.sep)
        self._roots = tuple(roots)

    def filter(self, record: py_logging.LogRecord) -> bool:
        return record.levelno >= py_logging.WARNING or record.pathname.startswith(self._roots)


def process_is_chief() -> bool:
    """Whether this process is the chief, from TF_CONFIG or Slurm (no TensorFlow)."""
    config = cluster_lib.parse_tf_config()
    if config is not None:
        return config.is_chief
    return os.environ.get("SLURM_PROCID", "0") == "0"


def configure_logging(is_chief: bool) -> None:
    """The chief logs tfdp's progress; other workers log only what goes wrong.

    TensorFlow's and TFDS' INFO lines (collective launches, dataset reads) are
    dropped everywhere: they bury the progress lines on a multi-worker run.
    """
    import tensorflow as tf

    tf.get_logger().setLevel(py_logging.WARNING)
    logging.get_absl_handler().addFilter(_OwnInfoOnly())
    logging.set_verbosity(logging.INFO if is_chief else logging.WARNING)
