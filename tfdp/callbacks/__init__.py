"""Keras callbacks for data-parallel `model.fit`.

`BackupAndRestore` backs a `fit` run up (chief-only writes, SIGTERM-aware)
and resumes it at the exact step, input position included.
"""

from tfdp.callbacks.backup_and_restore import PREEMPTION_EXIT_CODE, BackupAndRestore

__all__ = ["BackupAndRestore", "PREEMPTION_EXIT_CODE"]
