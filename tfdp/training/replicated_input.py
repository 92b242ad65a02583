"""`fit`'s input under balanced batches: every replica reads the whole global batch.

Under a strategy Keras splits each global batch of `fit`'s dataset over the
replicas (`strategy.experimental_distribute_dataset`: rebatched per replica
and, under MultiWorkerMirroredStrategy, auto-sharded per worker). Balanced
batches (`tfdp.training.balanced_batches`) cut each replica's share inside
the step instead, so each replica must be fed the whole global batch. This
module builds that input with the strategy's public input functions (see
`replicated`): each worker runs the dataset's pipeline once, and each of
its replicas receives every global batch whole. Keras accepts the result as
`fit`'s `x`, and still knows its length.

Every worker must therefore read the same global batches in the same order:
a deterministic pipeline, seeded alike on every worker (tfdp's
`pipelines.make_dataset` is).

It owns the input's layout only; `fit_balanced` is the `fit` wrapper
`tfdp.compile` installs.
"""

from __future__ import annotations

import functools
import inspect

import keras
import tensorflow as tf

from tfdp._upstream import keras_fit_resume
from tfdp.training import balanced_batches


def tile_each(dataset: tf.data.Dataset, times: int) -> tf.data.Dataset:
    """`dataset` with each batch (every component) concatenated `times` times along the batch."""

    def tiled(*element):
        element = element[0] if len(element) == 1 else element
        return tf.nest.map_structure(lambda t: tf.concat([t] * times, 0), element)

    return dataset.map(tiled)


def replicated(strategy: tf.distribute.Strategy, dataset: tf.data.Dataset):
    """A distributed dataset that feeds every replica each whole element of `dataset`.

    With one replica per worker (MultiWorkerMirroredStrategy over CPUs or
    one GPU each), every worker reads `dataset` as it is, unsharded
    (`distribute_datasets_from_function`). With several replicas on a worker
    each batch is tiled once per replica of the job and split back by
    the strategy's own rebatching (`experimental_distribute_dataset`,
    sharded by data across workers), so each replica receives one whole
    copy: one pipeline per worker, whose order every replica shares, and a
    length Keras still knows, at the cost of a host copy of each batch per
    replica.

    Args:
        strategy: the strategy (one or more workers).
        dataset: global batches, the same on every worker.
    """
    replicas = strategy.num_replicas_in_sync
    if len(strategy.extended.worker_devices) == 1:
        return strategy.distribute_datasets_from_function(lambda context: dataset)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return strategy.experimental_distribute_dataset(
        tile_each(dataset, replicas).with_options(options))


_FIT_SIGNATURE = inspect.signature(keras.Model.fit)


def _replicated_epoch(strategy: tf.distribute.Strategy, dataset):
    """`replicated`, for one epoch of a `BackupAndRestore.wrap` input (a tf.data.Dataset)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "With balance_batches, each epoch of a BackupAndRestore.wrap(...) input must be a "
            "tf.data.Dataset of global batches, the same on every worker. Received: "
            f"{type(dataset).__name__}. Build the epochs as tf.data.Datasets (for "
            "pipelines.make_dataset: under tf.distribute.get_strategy(), with the global "
            "batch as its batch), or balance_batches=False.")
    return replicated(strategy, dataset)


def fit_balanced(balance: balanced_batches.BalancedBatches, log: bool, fit, *args, **kwargs):
    """`model.fit` whose dataset reaches every replica whole, with the `Replanner` among its callbacks.

    `x` is a `tf.data.Dataset` of global batches, or
    `tfdp.callbacks.BackupAndRestore.wrap`'s input whose epochs are
    `tf.data.Dataset`s of global batches (each epoch, entered where the
    backup resumes, then reaches every replica whole).

    Raises:
        ValueError: `x` is neither (arrays, a generator, a distributed
            dataset, a wrapped input whose epochs are distributed datasets
            fail when fit reads them), or `y` or `class_weight` is given.
    """
    bound = _FIT_SIGNATURE.bind(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    arguments.update(arguments.pop("kwargs", {}))
    x = arguments.get("x")
    wrapped = isinstance(x, keras_fit_resume.EpochInput)
    if not (wrapped or isinstance(x, tf.data.Dataset)):
        raise ValueError(
            "With balance_batches, fit's `x` must be a tf.data.Dataset of global batches "
            "(the same on every worker), or tfdp.callbacks.BackupAndRestore.wrap(...) of "
            "such datasets: each replica reads every batch whole and cuts its share inside "
            "the step. Arrays, generators and distributed datasets are not supported with "
            f"it. Received: x of type {type(x).__name__}. Pass a tf.data.Dataset, or "
            "balance_batches=False.")
    for name in ("y", "class_weight"):
        if arguments.get(name) is not None:
            raise ValueError(
                f"With balance_batches, fit's `{name}` must be None: put labels and sample "
                f"weights in the dataset's elements. Received: {name} of type "
                f"{type(arguments[name]).__name__}.")
    strategy = balance.strategy
    if wrapped:
        # Its epochs are built (and entered) as fit runs; each is replicated
        # then. The global batch is learnt from the first timings.
        x.distribute = functools.partial(_replicated_epoch, strategy)
    else:
        batch = tf.nest.flatten(x.element_spec)[0].shape
        balance.set_global_batch(batch[0] if batch.rank else None)
        arguments["x"] = replicated(strategy, x)
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = list(callbacks.callbacks)
    arguments["callbacks"] = list(callbacks or []) + [balanced_batches.Replanner(balance,
                                                                                 log=log)]
    return fit(**arguments)
