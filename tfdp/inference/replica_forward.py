"""One worker's batches through the model, on every one of its replicas.

Each batch of `per_worker_batch` examples is cut into one equal slice per
local replica (in the input pipeline), each replica runs the model on its
slice under `strategy.run`, and the outputs come back concatenated in input
order. Nothing crosses workers: `strategy.run` only calls the function on
this worker's devices, so scoring needs no collective and a stopped worker
never blocks another (which Keras' `predict` under
MultiWorkerMirroredStrategy does: it all-gathers every batch's outputs).
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf


def local_replica_count(strategy: tf.distribute.Strategy) -> int:
    """Replicas of `strategy` on this worker (1 for the default strategy)."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has no device list
        return 1


def split_for_replicas(features, num_replicas: int):
    """`features` (a nest of `[per_worker_batch, ...]` tensors) as a tuple of
    `num_replicas` equal slices along the batch axis."""
    return tuple(
        tf.nest.map_structure(lambda t, i=i: tf.split(t, num_replicas, axis=0)[i], features)
        for i in range(num_replicas)
    )


class ReplicaForward:
    """Runs `model(x, training=False)` on every local replica of `strategy`.

    Args:
        model: a built Keras model, created under `strategy.scope()` (or any
            model, with the default strategy).
        strategy: the strategy the model's variables belong to.

    Call it with the tuple `split_for_replicas` makes; it returns the model's
    outputs for the whole batch, in order (a nest of tensors).
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        # Weakly: `tfdp.inference.predict` caches this object per model.
        self._model = weakref.ref(model)
        self.strategy = strategy
        self.num_replicas = local_replica_count(strategy)
        self._function = tf.function(self._forward, reduce_retracing=True)

    def _forward(self, slices):
        count = self.num_replicas
        values = self.strategy.experimental_distribute_values_from_function(
            # Under MultiWorkerMirroredStrategy replica ids are global:
            # worker w's replicas are w * count + 0 .. count - 1.
            lambda context: slices[context.replica_id_in_sync_group % count]
        )
        model = self._model()
        outputs = self.strategy.run(lambda x: model(x, training=False), args=(values,))
        return tf.nest.map_structure(
            lambda value: tf.concat(self.strategy.experimental_local_results(value), axis=0),
            outputs,
        )

    def __call__(self, slices):
        return self._function(slices)
