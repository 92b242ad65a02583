"""Helpers for the `pipelines` tests: strategies by name, and what replicas saw."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfdp

STRATEGIES = {
    "default": dict(kind="default"),
    "one_device": dict(kind="one_device"),
    "mirrored2": dict(kind="mirrored", cpu_replicas=2),
    "mirrored4": dict(kind="mirrored", cpu_replicas=4),
}

_cache: dict[str, tf.distribute.Strategy] = {}


def get_strategy(name: str) -> tf.distribute.Strategy:
    """`STRATEGIES[name]`, or `"multiworker_local2"`; built once per process."""
    if name not in _cache:
        if name == "multiworker_local2":
            _cache[name] = _local_multi_worker(["/cpu:0", "/cpu:1"])
        else:
            _cache[name] = tfdp.make_strategy(**STRATEGIES[name])
    return _cache[name]


def _local_multi_worker(devices: list[str]) -> tf.distribute.Strategy:
    """A one-worker MultiWorkerMirroredStrategy with one replica per device.

    What a worker with several GPUs runs: `tf.distribute` gives it one input
    pipeline for all its replicas (MWMS has no `PER_REPLICA` mode), which is
    the configuration a 2-process launch over 1-CPU workers never reaches.
    Built the way TensorFlow's own tests build it (`_from_local_devices`),
    with its own collective key range so it cannot join another strategy's
    collective groups (tensorflow/tensorflow#61314).
    """
    from tfdp._upstream import keras_multi_worker, strategy_internals

    keras_multi_worker.apply()  # As tfdp.make_strategy("multi_worker") does.

    class LocalMultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
        _collective_key_base = strategy_internals.reserve_collective_keys()

    return LocalMultiWorker._from_local_devices(devices)  # pylint: disable=protected-access


def collect(dataset, strategy) -> list[list[tuple[np.ndarray, ...]]]:
    """Per step, per replica: the element's `(features, label)` as NumPy arrays.

    Args:
        dataset: from `make_dataset`.
        strategy: its strategy.

    Returns:
        `steps[step][replica] = (features, label)`.
    """
    steps = []
    for element in dataset:
        per_replica = [strategy.experimental_local_results(c) for c in element]
        steps.append([tuple(np.asarray(c) for c in parts) for parts in zip(*per_replica)])
    return steps


def real_ids(steps) -> list[int]:
    """The ids (features) of every example in `collect` output, in order."""
    return [int(i) for step in steps for parts in step for i in parts[0]]


def id_dataset(num_examples: int) -> tf.data.Dataset:
    """`(i, i % 10)` for i < num_examples: features are the example's id."""
    return tf.data.Dataset.range(num_examples).map(lambda i: (i, i % 10))
