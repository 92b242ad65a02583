"""`tfdp.training.metric_reads`: one collective per metrics read, the values Keras' own read gives.

Under `tfdp.compile` with more than one replica, `model.get_metrics_result()`
and `model.reset_metrics()` (which `fit` and `evaluate` call eagerly at every
epoch and evaluation) are one `tf.function` call each. Checked on 2 logical
replicas with a strategy that counts its all-reduces at run time, against
Keras' own methods (`type(model).get_metrics_result(model)`, one reduction
per variable) on metrics whose variables differ between the replicas and use
each aggregation a sync-on-read variable can have.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import metric_reads

import strategy_testing

FEATURES = 3
GLOBAL_BATCH = 8
_rng = np.random.default_rng(5)
X = _rng.normal(size=(4 * GLOBAL_BATCH, FEATURES)).astype("float32")
# Unshuffled, replica 0 gets the first half of each global batch (all 1s)
# and replica 1 the second (all 0s): their metric variables differ.
Y = ((np.arange(4 * GLOBAL_BATCH) // (GLOBAL_BATCH // 2)) % 2 == 0).astype("float32")


class LabelMoments(keras.metrics.Metric):
    """Sums of the labels seen, in variables with each reduction a replica can ask for.

    `total` is summed over replicas, `mean_total` averaged over them,
    `first_total` read from replica 0 only, so a read that reduces any of
    them wrongly (or not at all) gives another result.
    """

    def __init__(self, name="label_moments"):
        super().__init__(name=name)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.mean_total = self.add_variable(shape=(), initializer="zeros", aggregation="mean",
                                            name="mean_total")
        self.first_total = self.add_variable(shape=(), initializer="zeros",
                                             aggregation="only_first_replica",
                                             name="first_total")
        self.offset = self.add_variable(shape=(2,), initializer="ones", name="offset")

    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = tf.reduce_sum(tf.cast(y_true, "float32"))
        self.total.assign_add(labels)
        self.mean_total.assign_add(3.0 * labels + 1.0)
        self.first_total.assign_add(labels + 0.5)

    def reset_state(self):
        for v in (self.total, self.mean_total, self.first_total):
            v.assign(0.0)
        self.offset.assign([2.0, 5.0])  # not zeros: the reset must be the metric's own

    def result(self):
        # Tensors, not the variables: logs must not change after the read.
        return {"label_total": tf.identity(self.total.value),
                "label_mean_total": tf.identity(self.mean_total.value),
                "label_first_total": tf.identity(self.first_total.value),
                "label_offset": tf.reduce_sum(self.offset.value)}


@pytest.fixture(scope="module")
def counted():
    """A model trained one epoch under a counting 2-replica strategy, and the counter."""
    strategy, (all_reduces, _, _) = strategy_testing.measuring_strategy(2, count_metric_reads=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        moments = LabelMoments()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                     metrics=["binary_accuracy", moments])
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    return model, all_reduces, moments


def _local_values(strategy, variable) -> list:
    """Each replica's own value of a sync-on-read variable (unreduced), as NumPy."""
    per_replica = strategy.run(lambda: tf.identity(variable.value))
    return [v.numpy() for v in strategy.experimental_local_results(per_replica)]


def _numpy(results: dict) -> dict:
    return tf.nest.map_structure(np.asarray, results)


def _all_reduces_during(counter, fn):
    before = int(counter.numpy())
    out = fn()
    return out, int(counter.numpy()) - before


@pytest.mark.slow
def test_one_all_reduce_per_read_with_the_values_of_keras_own_read(counted):
    model, all_reduces, moments = counted
    # The replicas saw different labels, so each aggregation matters.
    replicas = _local_values(model.distribute_strategy, moments.mean_total)
    assert len({round(float(r), 4) for r in replicas}) == 2
    ours, ours_count = _all_reduces_during(all_reduces, model.get_metrics_result)
    # Keras' own read reduces each variable on its own (not through the
    # strategy's cross-device ops on logical replicas, so not counted here).
    keras_own = type(model).get_metrics_result(model)
    assert ours_count == 1
    assert set(ours) == set(keras_own) == {"loss", "binary_accuracy", "label_moments"}
    assert set(ours["label_moments"]) == {
        "label_total", "label_mean_total", "label_first_total", "label_offset"}
    tf.nest.map_structure(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                          _numpy(ours), _numpy(keras_own))


@pytest.mark.slow
def test_reset_is_one_call_and_leaves_the_replicas_as_keras_own_reset(counted):
    model, all_reduces, _ = counted
    strategy = model.distribute_strategy
    variables = [v for m in model.metrics for v in m.variables]

    def reset_values(reset) -> list:
        model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
        _, count = _all_reduces_during(all_reduces, reset)
        assert count == 0
        return [_local_values(strategy, v) for v in variables]

    ours = reset_values(model.reset_metrics)
    keras_own = reset_values(lambda: type(model).reset_metrics(model))
    for variable, mine, theirs in zip(variables, ours, keras_own):
        np.testing.assert_array_equal(np.stack(mine), np.stack(theirs), err_msg=variable.path)
    # The metric's own reset_state ran (its offset is not zeros; a sum
    # variable assigned across replicas holds its share on each).
    offset = next(v for v in variables if v.path.endswith("offset"))
    np.testing.assert_array_equal(np.sum(_local_values(strategy, offset), axis=0), [2.0, 5.0])


@pytest.mark.slow
def test_fit_and_evaluate_logs_equal_keras_own_reads():
    """The same training with Keras' own eager reads gives the same history and evaluation."""

    def train(batched: bool):
        strategy = tfdp.make_strategy(cpu_replicas=2)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
            tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                         metrics=["binary_accuracy", LabelMoments()])
        if batched:
            assert isinstance(model.get_metrics_result.__self__,
                              metric_reads.BatchedMetricReads)
        else:
            for name in metric_reads.METHODS:
                delattr(model, name)
        history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0,
                            validation_data=(X[:12], Y[:12]), shuffle=False).history
        evaluation = model.evaluate(X, Y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
        return history, evaluation

    (history, evaluation), (keras_history, keras_evaluation) = train(True), train(False)
    assert set(history) == set(keras_history)
    for name, values in keras_history.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-6, err_msg=name)
    for name, value in keras_evaluation.items():
        np.testing.assert_allclose(evaluation[name], value, rtol=1e-6, err_msg=name)


def test_keras_own_methods_where_the_batched_read_does_not_apply():
    strategy = tfdp.make_strategy(cpu_replicas=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        tfdp.compile(model, optimizer="sgd", loss="binary_crossentropy")
    assert "get_metrics_result" not in vars(model)  # one replica: nothing to batch


class OwnMetricsResult(keras.Sequential):
    def get_metrics_result(self):
        return {**super().get_metrics_result(), "own": 1.0}


@pytest.mark.slow
def test_a_model_class_that_overrides_the_reads_keeps_its_own():
    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = OwnMetricsResult([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        tfdp.compile(model, optimizer="sgd", loss="binary_crossentropy")
    assert not set(metric_reads.METHODS) & set(vars(model))
    history = model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    assert history.history["own"] == [1.0]


@pytest.mark.slow
def test_a_second_tfdp_compile_replaces_the_installed_reads(counted):
    model, _, _ = counted
    first = model.get_metrics_result.__self__
    with model.distribute_strategy.scope():
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                     metrics=["binary_accuracy"])
    assert model.get_metrics_result.__self__ is not first
    model.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    assert set(model.get_metrics_result()) == {"loss", "binary_accuracy"}
