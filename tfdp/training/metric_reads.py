"""Reading and resetting a distributed model's metrics in one call each, not one per variable.

Keras' `fit` and `evaluate` reset the model's metrics (`Model.reset_metrics`)
at the start of every epoch and every evaluation, and read them
(`Model.get_metrics_result`) at the end of each, eagerly, outside any
`tf.function`. Under a multi-replica strategy every metric variable is a
sync-on-read variable (`aggregation="sum"`; keras-team/keras#21072, the fix
of keras-team/keras#21061), so each eager read of one is a
cross-replica reduction of its own (under `MultiWorkerMirroredStrategy` a
collective between the workers, which TensorFlow launches through a new
thread pool per call), and each reset is one eager assignment per variable
and replica. With `loss` and `accuracy` that is four collectives per read:
20-50 ms per read or reset between two CPU workers, four times per epoch
(0.1-0.2 s of a 0.75 s epoch on the time-to-accuracy benchmark).

`install(model)` shadows both methods on the instance with versions that do
the same in one `tf.function` call each: the read sums every metric variable
over the replicas in one batched all-reduce (`ReplicaContext.all_reduce` of
the list: one collective) and computes each metric's result from the sums
with Keras' public `Metric.stateless_result`; the reset assigns every
variable the value the metric's own `reset_state` gives it
(`Metric.stateless_reset_state`). The values are those Keras' own methods
return (the reduction is the one a read of the variable makes: a sum, a mean
over replicas, or the first replica's value). Inside a `tf.function` or a
replica context (Keras' train and test steps call `get_metrics_result`
there), with one replica, with metrics not built yet, or with a variable
whose aggregation or dtype the batched read does not handle, Keras' own
method runs (and a model class's own override is never replaced). One
difference: an `only_first_replica` variable reads as replica 0 of the whole
job on every worker, where Keras' eager read gives each worker its own first
replica's value.
"""

from __future__ import annotations

import keras
import tensorflow as tf

#: The `keras.Model` methods `install` shadows on the instance.
METHODS = ("get_metrics_result", "reset_metrics")

#: The name scope of the batched read's collective (in graphs and profiles;
#: tests that count a step's collectives leave out what is built under it).
NAME_SCOPE = "tfdp_metric_reads"

#: Variable aggregations the batched read reproduces (what a read of a
#: sync-on-read variable in cross-replica context returns for each).
_AGGREGATIONS = ("sum", "mean", "only_first_replica")


def _aggregation(variable) -> str:
    aggregation = getattr(variable, "aggregation", None)
    return getattr(aggregation, "value", aggregation) or "none"


class BatchedMetricReads:
    """One `tf.function` that reads all of a model's metrics, one that resets them.

    Args:
        model: a compiled `keras.Model`; its `distribute_strategy` has more
            than one replica.
    """

    def __init__(self, model: keras.Model):
        self._model = model
        self._key = None
        self._read = None
        self._reset = None

    def _variables(self) -> list | None:
        """The metric variables, or None where Keras' own methods must run."""
        metrics = self._model.metrics
        if not all(getattr(m, "built", True) for m in metrics):
            return None
        variables = [v for m in metrics for v in m.variables]
        if not variables:
            return None
        for v in variables:
            if _aggregation(v) not in _AGGREGATIONS or not tf.as_dtype(v.dtype).is_floating:
                return None
        return variables

    def _functions(self):
        """The read and reset functions for the current metrics (rebuilt when they change)."""
        variables = self._variables()
        if variables is None:
            return None
        key = (tuple(self._model.metrics), tuple(id(v) for v in variables))
        if key != self._key:
            self._read = tf.function(self._read_in_graph, autograph=False)
            self._reset = tf.function(self._reset_in_graph, autograph=False)
            self._key = key
        return self._read, self._reset

    def _read_in_graph(self):
        strategy = self._model.distribute_strategy
        metrics = list(self._model.metrics)
        num_replicas = strategy.num_replicas_in_sync

        def replica_fn():
            context = tf.distribute.get_replica_context()
            variables = [v for m in metrics for v in m.variables]
            local = []
            for v in variables:
                value = tf.identity(v.value)  # this replica's component, on its device
                if _aggregation(v) == "only_first_replica":
                    first = tf.equal(context.replica_id_in_sync_group, 0)
                    value = tf.where(first, value, tf.zeros_like(value))
                local.append(value)
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
            values = [s / num_replicas if _aggregation(v) == "mean" else s
                      for v, s in zip(variables, summed)]
            results, start = {}, 0
            for metric in metrics:
                count = len(metric.variables)
                result = metric.stateless_result(values[start:start + count])
                start += count
                if isinstance(result, dict):
                    results.update(result)
                else:
                    results[metric.name] = result
            return results

        with tf.name_scope(NAME_SCOPE):
            per_replica = strategy.run(replica_fn)
        return tf.nest.map_structure(lambda r: strategy.experimental_local_results(r)[0],
                                     per_replica)

    def _reset_in_graph(self):
        for metric in self._model.metrics:
            for variable, value in zip(metric.variables, metric.stateless_reset_state()):
                variable.assign(value)

    def _batched(self) -> bool:
        # Not inside a replica function (`strategy.run`): eagerly, under the
        # strategy's scope or outside any.
        in_replica = tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()
        return (tf.executing_eagerly() and not in_replica
                and self._model.distribute_strategy.num_replicas_in_sync > 1)

    def get_metrics_result(self) -> dict:
        """`Model.get_metrics_result`, with one collective for all metrics."""
        functions = self._functions() if self._batched() else None
        if functions is None:
            return type(self._model).get_metrics_result(self._model)
        with self._model.distribute_strategy.scope():
            return dict(functions[0]())

    def reset_metrics(self) -> None:
        """`Model.reset_metrics`, in one `tf.function` call."""
        functions = self._functions() if self._batched() else None
        if functions is None:
            return type(self._model).reset_metrics(self._model)
        with self._model.distribute_strategy.scope():
            functions[1]()


def install(model: keras.Model) -> None:
    """Makes `model.get_metrics_result` and `model.reset_metrics` one call each (see above).

    Instance attributes shadow the `keras.Model` methods; Keras' `fit`,
    `evaluate` and `_get_metrics_result_or_logs` find them on the instance.
    Nothing is installed for a one-replica strategy, nor for a model class
    that overrides either method (its own runs).
    """
    if model.distribute_strategy.num_replicas_in_sync < 2:
        return
    if any(getattr(type(model), name) is not getattr(keras.Model, name) for name in METHODS):
        return
    reads = BatchedMetricReads(model)
    model.get_metrics_result = reads.get_metrics_result
    model.reset_metrics = reads.reset_metrics
