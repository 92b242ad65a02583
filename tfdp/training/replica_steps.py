"""The inner loop of `tfdp.Trainer`: one replica's train and eval step, and the `tf.function`s that run them.

This module owns what happens inside a `tf.function` call (Orbit's
`StandardTrainer.train_step` side): the replica steps of
`tfdp.training.train_step` (the loss of the global batch as one device
computes it, micro-batches accumulated into one all-reduce, the optimizer
step skipped on every replica alike when not finite); the loss and metric
state; and a loop of `steps_per_loop` steps per call. Epochs,
checkpoints, logging and resuming, the outer loop, are
`tfdp.training.trainer`'s.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import tensorflow as tf

from tfdp.training import input_position
from tfdp.training import loss_normalization as norm_lib
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training import replicated_input
from tfdp.training import train_step as train_step_lib
from tfdp.training.batch import BatchConfig


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
        loss_normalization: `"global"` or `"per_replica"`
            (`tfdp.training.loss_normalization`).
        balance: `None`, or the `tfdp.training.balanced_batches.BalancedBatches`:
            every replica is fed each global batch whole (`distribute`) and
            computes its share of it.

    Attributes:
        train_loss, eval_loss: `keras.metrics.Mean` of the loss, as one device logs it.
        train_metrics, eval_metrics: the metrics, one set for each.
        train_loop: `tf.function` `(iterator, num_steps)`: `num_steps` train steps.
        train_loop_until_end: `tf.function` `(iterator, num_steps)`: up to
            `num_steps` train steps, fewer when the iterator ends; returns
            the steps run (an int64 scalar), for inputs of unknown size.
        eval_step: `tf.function` `(data)`: one evaluation step.
    """

    def __init__(self, *, model: keras.Model, optimizer, loss, strategy: tf.distribute.Strategy,
                 batch: BatchConfig, metrics: Sequence[Any] | None, jit_compile: bool,
                 loss_normalization: str = norm_lib.GLOBAL, balance=None):
        self.model = model
        self.balance = balance
        self.optimizer = optimizer
        self.strategy = strategy
        self.batch = batch
        self._loss = norm_lib.SingleLoss(model, loss)
        guard = nonfinite_lib.guard_of(optimizer)
        self._train_normalizer = train_step_lib.train_normalizer(
            loss_normalization, batch.num_replicas, batch.accum_steps,
            guard is not None and guard.steps_locally,
        )
        self._eval_normalizer = norm_lib.Normalizer(loss_normalization, batch.num_replicas, 1)
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
        self.train_loop_until_end = tf.function(self._train_loop_until_end_fn)
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

    def _track(self, loss_metric, metrics, normalizer):
        def track(share, loss, denominators, term_losses, x, y, y_pred, sample_weight):
            del x, term_losses  # one loss term
            normalizer.report(loss_metric, share, loss, denominators)
            for metric in metrics:
                metric.update_state(y, y_pred, sample_weight=sample_weight)

        return track

    def _replica_train_step(self, data):
        train_step_lib.replica_train_step(
            model=self.model, optimizer=self.optimizer, loss_source=self._loss,
            normalizer=self._train_normalizer, accum_steps=self.batch.accum_steps, data=data,
            track=self._track(self.train_loss, self.train_metrics, self._train_normalizer),
            balance=self.balance,
        )

    def _step_fn(self, data):
        # The loops around it need AutoGraph (`for _ in tf.range`), tfdp's step
        # does not: converted, AutoGraph re-parses its whole call tree at the
        # first trace (seconds). Keras' fit does not convert its steps either.
        self.strategy.run(tf.autograph.experimental.do_not_convert(self._replica_train_step),
                          args=(data,))

    def _train_loop_fn(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            self._step(next(iterator))

    def _train_loop_until_end_fn(self, iterator, num_steps):
        ran = tf.constant(0, tf.int64)
        for _ in tf.range(num_steps):
            data = iterator.get_next_as_optional()
            if not data.has_value():
                break
            self._step(data.get_value())
            ran += 1
        return ran

    def _skip_loop_fn(self, iterator, num_steps):
        for _ in tf.range(num_steps):
            next(iterator)

    def _replica_eval_step(self, data):
        train_step_lib.replica_eval_step(
            model=self.model, loss_source=self._loss, normalizer=self._eval_normalizer, data=data,
            track=self._track(self.eval_loss, self.eval_metrics, self._eval_normalizer),
        )

    def _eval_step_fn(self, data):
        self.strategy.run(tf.autograph.experimental.do_not_convert(self._replica_eval_step),
                          args=(data,))

    def distribute(self, dataset, skip: int):
        """A distributed iterator over `dataset`, entered at its batch `skip`.

        How the first `skip` batches are passed over, and what that costs, is
        `tfdp.training.input_position`'s: a dataset with `start_at_batch`
        (`pipelines.make_dataset`'s) starts there without reading them.
        """
        dataset, left = input_position.start_at_batch(dataset, skip)
        if self.balance is not None:
            if not isinstance(dataset, tf.data.Dataset):
                raise ValueError(
                    "With balance_batches, the Trainer's dataset must be a tf.data.Dataset "
                    "(or a callable returning one) of global batches, the same on every "
                    "worker: each replica reads every batch whole and cuts its share inside "
                    f"the step. Received: {type(dataset).__name__}. Pass a tf.data.Dataset, "
                    "or balance_batches=False.")
            dataset = replicated_input.replicated(self.strategy, dataset)
        elif isinstance(dataset, tf.data.Dataset):
            dataset = self.strategy.experimental_distribute_dataset(dataset)
        iterator = iter(dataset)
        if left:
            self._skip_loop(iterator, tf.constant(left))
        return iterator
