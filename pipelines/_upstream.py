"""Private `tf.distribute` state that `pipelines` works around (TensorFlow 2.21).

This module owns the one place where `pipelines` writes a private attribute
of a TensorFlow object; everything else in the package uses public APIs.

`DistributedDatasetsFromFunction.cardinality` is the cardinality of the
first input pipeline's dataset (`_cardinality(self._datasets[0])` in
`tensorflow/python/distribute/input_lib.py`, `build()`), which counts
per-replica batches. When one input pipeline feeds R replicas, as
`MultiWorkerMirroredStrategy` does on a worker with R GPUs (it has no
`InputReplicationMode.PER_REPLICA`), the distributed dataset therefore
reports R x its real number of global steps. Keras takes that number as the
steps per epoch (`TFDatasetAdapter.num_batches`): the progress bar is wrong,
and every epoch ends with "Your input ran out of data". `set_global_steps`
corrects the reported number.

`tests/pipelines/test_upstream.py` fails when TensorFlow reports the right
number by itself (then delete `set_global_steps`) or when the attribute moves.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from absl import logging


def set_global_steps(dataset, steps: int | None) -> None:
    """Makes `dataset.cardinality` report `steps`, its number of global steps.

    The iterator is unaffected: it reads `_cardinality` only to special-case
    infinite and empty datasets, and `steps` is finite and positive whenever
    the reported number is wrong.

    Args:
        dataset: what `strategy.distribute_datasets_from_function` returned:
            a `tf.data.Dataset` (default strategy; left alone) or a
            `tf.distribute.DistributedDataset`.
        steps: global steps per epoch; `None` for an endless dataset (left
            alone: it already reports `tf.data.INFINITE_CARDINALITY`).
    """
    if steps is None or isinstance(dataset, tf.data.Dataset):
        return
    reported = int(dataset.cardinality)
    if reported == steps:
        return
    if hasattr(dataset, "_cardinality"):
        # pylint: disable=protected-access
        dataset._cardinality = np.int64(steps)
    if int(dataset.cardinality) != steps:
        logging.warning(
            "pipelines: the distributed dataset reports %d steps per epoch but "
            "yields %d, and this TensorFlow version does not let pipelines "
            "correct it. Pass steps_per_epoch=%d to model.fit/evaluate.",
            reported, steps, steps,
        )
