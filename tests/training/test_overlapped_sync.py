"""Overlapped local SGD / DiLoCo (`overlap_sync=True`) against a NumPy simulation of the delayed algorithm.

The data, model and optimizers are test_local_sync's: a linear model
trained with mean squared error on 2 logical CPU replicas, each replica on
its own half of every global batch with its own momentum. The simulation
(`numpy_overlapped_training`) is `tfdp.distribute.overlapped_sync`'s
algorithm: at the end of window t the sums of window t−1's snapshots are
applied (the outer step, or the average) to the anchor, each replica
carries its progress since its snapshot onto it, snapshots again and sends;
an epoch's end flushes (applies what is in flight, then closes the window
with a blocking synchronisation). tfdp must equal it to 1e-5 through
`tfdp.compile` + `fit` and through `tfdp.Trainer`, and must differ from the
blocking algorithm (the delay is real). The collectives are counted at run
time.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.distribute import local_sync as local_sync_lib
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training.batch import BatchConfig

import strategy_testing
import test_local_sync as plain
from test_local_sync import (EPOCHS, FEATURES, GLOBAL_BATCH, INITIAL, INNER_LR, INNER_MOMENTUM,
                             OUTER_LR, OUTER_MOMENTUM, STEPS_PER_EPOCH, X, Y)


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def numpy_overlapped_training(sync_every, diloco, epochs=EPOCHS, replicas=2, steps=None):
    """The weights `[kernel, bias]` after overlapped local SGD / DiLoCo, simulated in NumPy.

    `steps`: stop after that many steps in all (then flush), as `Trainer.train(steps=...)`.
    """
    features = np.concatenate([X, np.ones((len(X), 1), "float32")], axis=1).astype("float64")
    start = np.concatenate([INITIAL[0].ravel(), INITIAL[1]]).astype("float64")
    weights = [start.copy() for _ in range(replicas)]
    momenta = [np.zeros_like(start) for _ in range(replicas)]  # never averaged
    snapshots = [None] * replicas
    state = {"anchor": start.copy(), "outer_momentum": np.zeros_like(start), "pending": False,
             "since": 0}

    def outer_step(mean):
        anchor = state["anchor"]
        if not diloco:
            return mean.copy()
        pseudo_gradient = anchor - mean  # Nesterov, PyTorch's form, as test_local_sync
        state["outer_momentum"] = OUTER_MOMENTUM * state["outer_momentum"] + pseudo_gradient
        return anchor - OUTER_LR * (pseudo_gradient + OUTER_MOMENTUM * state["outer_momentum"])

    def apply_arrived():
        if not state["pending"]:
            return
        state["anchor"] = outer_step(sum(snapshots) / replicas)
        for m in range(replicas):  # the progress since the snapshot, carried
            weights[m] = state["anchor"] + (weights[m] - snapshots[m])
        state["pending"] = False

    def turn():  # a window's end: apply the last window's sums, snapshot, send
        apply_arrived()
        for m in range(replicas):
            snapshots[m] = weights[m].copy()
        state["pending"], state["since"] = True, 0

    def flush():  # sync_pending: apply what is in flight, close the window, blocking
        apply_arrived()
        if state["since"]:
            state["anchor"] = outer_step(sum(weights) / replicas)
            for m in range(replicas):
                weights[m] = state["anchor"].copy()
            state["since"] = 0

    share = GLOBAL_BATCH // replicas
    taken = 0
    for _ in range(epochs):
        for step in range(STEPS_PER_EPOCH):
            if steps is not None and taken == steps:
                break
            for m in range(replicas):
                rows = slice(step * GLOBAL_BATCH + m * share, step * GLOBAL_BATCH + (m + 1) * share)
                error = features[rows] @ weights[m] - Y[rows, 0]
                gradient = 2.0 * features[rows].T @ error / share
                momenta[m] = INNER_MOMENTUM * momenta[m] - INNER_LR * gradient
                weights[m] = weights[m] + momenta[m]
            taken += 1
            state["since"] += 1
            if state["since"] == sync_every:
                turn()
        flush()  # an epoch's end (and the end of training)
    return [weights[0][:-1].reshape(FEATURES, 1), weights[0][-1:]]


def fit(strategy, sync_every, kind, epochs=EPOCHS, callbacks=(), **fit_kwargs):
    with strategy.scope():
        model = plain.linear_model()
        tfdp.compile(model, optimizer=plain.inner_optimizer(), loss="mse", sync_every=sync_every,
                     outer_optimizer=plain.outer_optimizer(kind), overlap_sync=True)
    model.fit(plain.dataset(), epochs=epochs, verbose=0, callbacks=list(callbacks), **fit_kwargs)
    return model


def train(strategy, sync_every, kind, model_dir=None, steps=EPOCHS * STEPS_PER_EPOCH,
          checkpoint_every=None, **kwargs):
    with strategy.scope():
        model = plain.linear_model()
        optimizer = plain.inner_optimizer()
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                           batch=BatchConfig.from_global(GLOBAL_BATCH, 2), model_dir=model_dir,
                           checkpoint_every=checkpoint_every, sync_every=sync_every,
                           outer_optimizer=plain.outer_optimizer(kind), overlap_sync=True,
                           **kwargs)
    trainer.train(plain.dataset(), steps=steps)
    return model, trainer


def test_the_simulation_differs_from_blocking_local_steps():
    """The reference is not the blocking algorithm: a window's sums arrive one window late."""
    for sync_every, diloco in ((2, False), (2, True)):
        delayed = numpy_overlapped_training(sync_every, diloco)
        blocking = plain.numpy_local_training(sync_every, diloco)
        assert np.abs(delayed[0] - blocking[0]).max() > 1e-3
    # With windows that never end inside an epoch, both are the same flush.
    for a, b in zip(numpy_overlapped_training(5, True), plain.numpy_local_training(5, True)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


CASES = [(2, None), (2, "diloco"), (1, "diloco")]


@pytest.mark.slow
@pytest.mark.parametrize("sync_every,kind", CASES)
def test_fit_equals_numpy_simulation(two_replicas, sync_every, kind):
    model = fit(two_replicas, sync_every, kind)
    plain.assert_weights(model, numpy_overlapped_training(sync_every, kind is not None))
    for copies in plain.replica_copies(two_replicas, model):
        np.testing.assert_array_equal(copies[0], copies[1])
    local_sync = model.optimizer.local_sync
    assert isinstance(local_sync, local_sync_lib.OverlappedSync)
    assert int(local_sync.pending.numpy()) == 0 and local_sync._thread is None  # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize("sync_every,kind", [(2, "diloco")])
def test_trainer_equals_numpy_simulation(two_replicas, sync_every, kind):
    model, _ = train(two_replicas, sync_every, kind)
    plain.assert_weights(model, numpy_overlapped_training(sync_every, kind is not None))


@pytest.mark.slow
def test_one_weight_all_reduce_per_window_and_none_between():
    """One epoch of 5 steps, sync_every=2: windows end after steps 2 and 4 (two overlapped
    all-reduces), and the epoch's end flushes the fifth step (one blocking all-reduce)."""
    strategy, (all_reduces, values, all_gathers) = strategy_testing.measuring_strategy(2)
    fit(strategy, 2, "diloco", epochs=1)
    assert int(all_reduces.numpy()) == 3
    assert int(values.numpy()) == 3 * (FEATURES + 1 + 1)
    assert int(all_gathers.numpy()) == 0


@pytest.mark.slow
def test_trainer_resumes_exactly_from_a_checkpoint_with_an_all_reduce_in_flight(two_replicas,
                                                                                tmp_path):
    """sync_every=2, saves every 3 steps: at step 3 window 1's sums are in flight (sent after
    step 2, due after step 4). The save waits for them and keeps them, with each replica's
    snapshot; a run stopped there and resumed equals the uninterrupted one, bit for bit, and
    the simulation."""
    want = numpy_overlapped_training(2, True)
    straight, _ = train(two_replicas, 2, "diloco", model_dir=str(tmp_path / "a"),
                        checkpoint_every=3)
    train(two_replicas, 2, "diloco", model_dir=str(tmp_path / "b"), steps=3, checkpoint_every=3)
    resumed, trainer = train(two_replicas, 2, "diloco", model_dir=str(tmp_path / "b"),
                             checkpoint_every=3)
    plain.assert_weights(straight, want)
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH


STOPPED_AT_SYNC = "stopped on every worker at the next synchronisation"


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "trainer"])
def test_the_nonfinite_limit_stops_every_replica_when_the_sums_are_applied(two_replicas, loop):
    """NaN on replica 1 in steps 1 and 2 reaches max_consecutive_nonfinite=2 at step 2, the end
    of window 1 (sync_every=2): its request rides in that window's overlapped all-reduce, is
    agreed when the sums are applied after step 4, and training stops there, on every replica
    alike, with the window flushed and the weights equal."""
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    with two_replicas.scope():
        model = plain.linear_model()
        optimizer = plain.inner_optimizer()
    data = plain._nan_on_replica_1([0, 1])  # pylint: disable=protected-access
    if loop == "fit":
        with two_replicas.scope():
            tfdp.compile(model, optimizer=optimizer, loss="mse", sync_every=2,
                         max_consecutive_nonfinite=2, overlap_sync=True)
        guard = model.optimizer
        with pytest.raises(nonfinite_lib.NonFiniteError, match=STOPPED_AT_SYNC):
            model.fit(data, epochs=1, verbose=0, callbacks=[Count()])
    else:
        trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=two_replicas,
                               batch=BatchConfig.from_global(GLOBAL_BATCH, 2), sync_every=2,
                               max_consecutive_nonfinite=2, overlap_sync=True)
        guard = trainer.optimizer
        with pytest.raises(nonfinite_lib.NonFiniteError, match=STOPPED_AT_SYNC):
            trainer.train(data, steps=STEPS_PER_EPOCH)
    local_sync = guard.local_sync
    assert int(local_sync.stopped.numpy()) == 1
    assert int(local_sync.steps_since_sync.numpy()) == 0 and int(local_sync.pending.numpy()) == 0
    for copies in plain.replica_copies(two_replicas, model):
        np.testing.assert_array_equal(copies[0], copies[1])
    if loop == "fit":
        assert seen == [0, 1, 2]  # step 4's batch end raised before the user's callback


def test_config_round_trip_keeps_the_overlap():
    guard = nonfinite_lib.NonFiniteGuard(
        keras.optimizers.SGD(0.1),
        local_sync=local_sync_lib.make(4, local_sync_lib.diloco_outer_optimizer(), overlap=True),
    )
    again = nonfinite_lib.NonFiniteGuard.from_config(guard.get_config())
    assert isinstance(again.local_sync, local_sync_lib.OverlappedSync)
    assert again.local_sync.sync_every == 4 and again.local_sync.overlap
    plain_guard = nonfinite_lib.NonFiniteGuard(keras.optimizers.SGD(0.1),
                                               local_sync=local_sync_lib.LocalSync(4))
    assert not nonfinite_lib.NonFiniteGuard.from_config(plain_guard.get_config()).local_sync.overlap


@pytest.mark.parametrize("kwargs,match", [
    (dict(overlap_sync=True), r"overlap_sync=True cannot be combined with sync_every=1 and no "
                              r"outer_optimizer.*Use sync_every > 1"),
    (dict(overlap_sync=True, sync_every=4, steps_per_execution=3),
     r"overlap_sync=True cannot be combined with steps_per_execution=3.*divides sync_every"),
    (dict(overlap_sync="yes", sync_every=4), r"`overlap_sync` must be True .* or False"),
])
def test_bad_overlap_options_are_refused_by_name(two_replicas, kwargs, match):
    with two_replicas.scope(), pytest.raises(ValueError, match=match):
        tfdp.compile(plain.linear_model(), optimizer="sgd", loss="mse", **kwargs)


def test_trainer_refuses_steps_per_loop_that_do_not_divide_the_window(two_replicas):
    with two_replicas.scope():
        model = plain.linear_model()
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"steps_per_execution=3 \(steps_per_loop\)"):
        tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=two_replicas,
                     batch=BatchConfig.from_global(GLOBAL_BATCH, 2), sync_every=4,
                     steps_per_loop=3, overlap_sync=True)
