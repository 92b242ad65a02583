"""Keras callbacks for data-parallel `model.fit`, public as `tfdp.callbacks`.

`backup_and_restore.BackupAndRestore` backs a `fit` run up (chief-only
writes, SIGTERM-aware) and resumes it at the exact step, input position
included.
"""
