"""The TensorBoard scalars of a training run, one tag set for `Trainer` and `fit`.

`tfdp.Trainer` and `tfdp-train --loop=fit` (its progress callback) write the
same tags, so their event files compare side by side:

- at step 0, the batch layout: `batch/per_replica`, `batch/replicas`,
  `batch/accum_steps`, `batch/global` (examples);
- at each logged step, the logs under their own names (`loss`, metrics),
  `learning_rate`, `examples_per_second` and, when non-finite steps are
  handled, `nonfinite/skipped_steps`.

Call inside `writer.as_default(step=...)`.
"""

from __future__ import annotations

from typing import Mapping

import tensorflow as tf


def write_batch_layout(batch) -> None:
    """Writes `batch/*`: a `tfdp.BatchConfig`'s per-replica, replicas, accumulation and global sizes."""
    tf.summary.scalar("batch/per_replica", batch.per_replica)
    tf.summary.scalar("batch/replicas", batch.num_replicas)
    tf.summary.scalar("batch/accum_steps", batch.accum_steps)
    tf.summary.scalar("batch/global", batch.global_batch)


def write_progress(logs: Mapping[str, float], *, learning_rate: float,
                   examples_per_second: float, skipped_steps: int | None = None) -> None:
    """Writes the logs, `learning_rate`, `examples_per_second` and `nonfinite/skipped_steps`.

    Args:
        logs: name -> value (the mean loss and metrics since the last write).
        learning_rate: the optimizer's current learning rate.
        examples_per_second: global examples per second since the last write.
        skipped_steps: non-finite steps skipped so far; `None` writes nothing
            (no handling).
    """
    for name, value in logs.items():
        tf.summary.scalar(name, float(value))
    tf.summary.scalar("learning_rate", learning_rate)
    tf.summary.scalar("examples_per_second", examples_per_second)
    if skipped_steps is not None:
        tf.summary.scalar("nonfinite/skipped_steps", skipped_steps)
