"""Entering an epoch's input part-way through: the seek protocol and its fallbacks.

A resumed run continues an epoch at batch `b`. A distributed iterator cannot
be checkpointed (tensorflow/tensorflow#56372), so the input is rebuilt and
its first `b` batches must be passed over. This module owns how, for
`tfdp.Trainer` and `tfdp.callbacks.BackupAndRestore` alike; it does not know
any input pipeline, and the library never imports `tfdp.pipelines`.

A dataset can say how to enter it at a batch: an attribute
`start_at_batch(batch) -> dataset` (`START_AT_BATCH`) returning a dataset of
the same kind whose first element is global batch `batch` of the epoch and
whose other batches are the epoch's following ones, unchanged (so its
cardinality is the epoch's minus `batch`). `pipelines.make_dataset` gives its
datasets one that computes where each input pipeline's examples start and
reads from there: nothing before the position is decoded, preprocessed,
batched or copied to a device (see `tfdp.pipelines.input_pipeline`).

Any other input pays for what it skips:

- a `tf.data.Dataset` without the attribute: `dataset.skip(batch)`, which
  pulls every skipped batch through the dataset's own pipeline (reading,
  decoding, preprocessing and batching it; tf.data has no generic seek) but
  copies nothing to the devices;
- a distributed dataset without it: its iterator is advanced `batch` times,
  which also splits each skipped batch and copies it to the devices.

Either way the cost is the input work of the epoch up to the position, never
more: the position is within the current epoch.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

#: The name of the method a dataset defines to be entered at a batch.
START_AT_BATCH = "start_at_batch"


def can_seek(dataset: Any) -> bool:
    """Whether `dataset` can be entered at a batch without reading what comes before."""
    return callable(getattr(dataset, START_AT_BATCH, None))


def start_at_batch(dataset: Any, batch: int) -> tuple[Any, int]:
    """`dataset` entered at global batch `batch` of its epoch, as far as it can be.

    Args:
        dataset: a `tf.data.Dataset` of global batches or a
            `tf.distribute.DistributedDataset`, for one epoch.
        batch: global batches of the epoch already trained (>= 0).

    Returns:
        `(dataset, still_to_skip)`: the dataset to iterate, and how many of
        its first batches the caller must still consume and discard from its
        iterator (non-zero only for a distributed dataset without
        `start_at_batch`).

    Raises:
        TypeError: the dataset's `start_at_batch` returned something else
            than a dataset.
    """
    if batch < 0:
        raise ValueError(f"`batch` must be >= 0. Received: batch={batch}")
    if not batch:
        return dataset, 0
    if can_seek(dataset):
        entered = getattr(dataset, START_AT_BATCH)(batch)
        if not isinstance(entered, (tf.data.Dataset, tf.distribute.DistributedDataset)):
            raise TypeError(
                f"`{START_AT_BATCH}({batch})` of the input must return a tf.data.Dataset or "
                f"a distributed dataset, the epoch from that batch on. Received: "
                f"{type(entered).__name__}"
            )
        return entered, 0
    if isinstance(dataset, tf.data.Dataset):
        return dataset.skip(batch), 0
    return dataset, batch
