"""The inner loop of `tfdp.Trainer`: one replica's train and eval step, and the `tf.function`s that run them.

This module owns what happens inside a `tf.function` call (Orbit's
`StandardTrainer.train_step` side): the per-example loss of any Keras loss,
averaged over the global batch; micro-batches accumulated into one
all-reduce (`tfdp.training.accumulation`); the optimizer step, skipped on
every replica alike when not finite (`tfdp.training.nonfinite`); the loss and
metric state; and a loop of `steps_per_loop` steps per call. Epochs,
checkpoints, logging and resuming, the outer loop, are
`tfdp.training.trainer`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfdp.training import accumulation
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training.batch import BatchConfig


def _per_example_loss_fn(loss) -> Callable[[Any, Any], tf.Tensor]:
    """Turns a Keras loss (name, function or `Loss`) into y, y_pred -> [batch] losses."""
    resolved = keras.losses.get(loss)
    if resolved is None:
        raise ValueError(f"`loss` must name or be a Keras loss. Received: loss={loss!r}")
    if isinstance(resolved, keras.losses.Loss):
        per_example = resolved.call  # unreduced, as Loss subclasses define it
    else:
        per_example = resolved

    def fn(y, y_pred):
        values = tf.convert_to_tensor(per_example(y, y_pred))
        if values.shape.rank and values.shape.rank > 1:
            # Keras' sum_over_batch_size averages over every element.
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    return fn


_ACCURACY_FOR_LOSS = {
    "sparse_categorical_crossentropy": keras.metrics.SparseCategoricalAccuracy,
    "categorical_crossentropy": keras.metrics.CategoricalAccuracy,
    "binary_crossentropy": keras.metrics.BinaryAccuracy,
}


def _loss_name(loss) -> str:
    """`"sparse_categorical_crossentropy"` for that loss's name, class or function."""
    if isinstance(loss, str):
        return loss
    name = getattr(loss, "fn", None) or loss
    name = getattr(name, "__name__", None) or type(loss).__name__
    # SparseCategoricalCrossentropy -> sparse_categorical_crossentropy
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


class ReplicaSteps:
    """One replica's train and eval step under `strategy`, and the loops that run them.

    Built by `tfdp.Trainer` after it has wrapped and built the optimizer;
    metric objects are created in `strategy.scope()` here.

    Args:
        model: the model, its variables created in `strategy.scope()`.
        optimizer: the optimizer the train step applies gradients with
            (Trainer's wrapper), built for the model's trainable variables.
        loss: a Keras loss (name, function or `keras.losses.Loss`).
        strategy: the `tf.distribute.Strategy`.
        batch: the `BatchConfig` (global batch, replicas, accumulation).
        metrics: Keras metric names or instances.
        jit_compile: compile each step's `strategy.run` with XLA.

    Attributes:
        train_loss, eval_loss: `keras.metrics.Mean` of the per-example loss.
        train_metrics, eval_metrics: the metrics, one set for each.
        train_loop: `tf.function` `(iterator, num_steps)`: `num_steps` train steps.
        eval_step: `tf.function` `(data)`: one evaluation step.
    """

    def __init__(self, *, model: keras.Model, optimizer, loss, strategy: tf.distribute.Strategy,
                 batch: BatchConfig, metrics: Sequence[Any] | None, jit_compile: bool):
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.batch = batch
        self._per_example_loss = _per_example_loss_fn(loss)
        self.loss_name = _loss_name(loss)
        self._guard = nonfinite_lib.guard_of(optimizer)
        with strategy.scope():
            self.train_loss = keras.metrics.Mean(name="loss")
            self.eval_loss = keras.metrics.Mean(name="loss")
            self.train_metrics = [self._metric(m) for m in metrics or ()]
            self.eval_metrics = [self._metric(m, copy=True) for m in metrics or ()]
        # As Keras does: XLA compiles the whole `strategy.run` of one step.
        self._step = tf.function(self._step_fn, jit_compile=True) if jit_compile else self._step_fn
        self.train_loop = tf.function(self._train_loop_fn)
        self._skip_loop = tf.function(self._skip_loop_fn)
        self.eval_step = tf.function(self._eval_step_fn)

    def _metric(self, metric, copy: bool = False):
        if isinstance(metric, str):
            if metric in ("accuracy", "acc"):
                # As model.compile does: pick the accuracy that fits the loss.
                return _ACCURACY_FOR_LOSS.get(self.loss_name, keras.metrics.CategoricalAccuracy)(
                    name="accuracy"
                )
            return keras.metrics.get(metric)
        if not isinstance(metric, keras.metrics.Metric):
            raise TypeError(
                f"`metrics` entries must be metric names or keras.metrics.Metric "
                f"instances. Received: {metric!r}"
            )
        if copy:
            return type(metric).from_config(metric.get_config())
        if metric.variables and not self.strategy.extended.variable_created_in_scope(
            getattr(metric.variables[0], "value", metric.variables[0])
        ):
            raise ValueError(
                f"Metric {metric.name!r} was created outside `strategy.scope()`; its "
                f"state would not be aggregated over replicas. Create it inside the "
                f"scope, or pass its name instead."
            )
        return metric

    def _replica_train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.model.trainable_variables
        global_batch = float(self.batch.global_batch)
        # Regularisation: once per optimizer step in total, over every
        # replica and micro-batch.
        regularization_share = 1.0 / (self.batch.num_replicas * self.batch.accum_steps)

        def micro_batch_loss(micro_batch):
            mx, my, msw = micro_batch
            y_pred = self.model(mx, training=True)
            per_example = tf.cast(self._per_example_loss(my, y_pred), tf.float32)
            weights = tf.ones_like(per_example) if msw is None else tf.cast(msw, tf.float32)
            loss = tf.reduce_sum(per_example * weights) / global_batch
            if self.model.losses:
                loss += tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]) * (
                    regularization_share
                )
            self.train_loss.update_state(per_example, sample_weight=weights)
            for metric in self.train_metrics:
                metric.update_state(my, y_pred, sample_weight=msw)
            if self._guard is not None:  # a non-finite loss makes a gradient NaN
                loss = nonfinite_lib.fold_loss_into_gradients(loss, variables)
            return self.optimizer.scale_loss(loss)

        gradients = accumulation.sum_micro_batch_gradients(
            (x, y, sample_weight), self.batch.accum_steps, variables, micro_batch_loss
        )
        # Losses are already divided by the global batch: the all-reduce SUM
        # inside apply_gradients completes the mean. A non-finite step is
        # skipped there, on every replica alike (tfdp.training.nonfinite).
        self.optimizer.apply_gradients(zip(gradients, variables))

    def _step_fn(self, data):
        self.strategy.run(self._replica_train_step, args=(data,))

    def _train_loop_fn(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            self._step(next(iterator))

    def _skip_loop_fn(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            next(iterator)

    def _replica_eval_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.model(x, training=False)
        per_example = tf.cast(self._per_example_loss(y, y_pred), tf.float32)
        weights = (
            tf.ones_like(per_example) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        )
        self.eval_loss.update_state(per_example, sample_weight=weights)
        for metric in self.eval_metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)

    def _eval_step_fn(self, data):
        self.strategy.run(self._replica_eval_step, args=(data,))

    def distribute(self, dataset, skip: int):
        """A distributed iterator over `dataset`, with `skip` batches already consumed."""
        if isinstance(dataset, tf.data.Dataset):
            dataset = self.strategy.experimental_distribute_dataset(dataset.skip(skip))
            return iter(dataset)
        iterator = iter(dataset)
        if skip:
            self._skip_loop(iterator, tf.constant(skip))
        return iterator
