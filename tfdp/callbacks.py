"""Public API: Keras callbacks for data-parallel `model.fit`.

`BackupAndRestore` backs a `fit` run up (chief-only writes, SIGTERM-aware)
and resumes it at the exact step, input position included. It lives in the
training wing (`tfdp.training.callbacks`); this module is its public name.
"""

from tfdp.training.callbacks.backup_and_restore import PREEMPTION_EXIT_CODE, BackupAndRestore

__all__ = ["BackupAndRestore", "PREEMPTION_EXIT_CODE"]
