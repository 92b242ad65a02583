"""Local SGD and DiLoCo (`sync_every`, `outer_optimizer`) against a NumPy simulation.

A linear model trained with mean squared error on 2 logical CPU replicas,
through `tfdp.compile` + `fit` and through `tfdp.Trainer`, must equal a NumPy
simulation of the algorithms (local SGD: Stich 2019; DiLoCo: Douillard et al.
2023, Algorithm 1, with the paper's Nesterov outer step): each replica steps
on its own half of every global batch with its own momentum, and every
`sync_every` steps (and at the end of each epoch) the weights are averaged,
or the outer optimizer steps from the last synchronised weights along
`anchor − average`. The collectives are counted at run time: one all-reduce
of the weights per window and none in between.
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

FEATURES = 5
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 5
EPOCHS = 2
INNER_LR = 0.05
INNER_MOMENTUM = 0.5
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
TOLERANCE = 1e-5

_rng = np.random.default_rng(3)
X = _rng.normal(size=(GLOBAL_BATCH * STEPS_PER_EPOCH, FEATURES)).astype("float32")
Y = (X @ _rng.normal(size=(FEATURES, 1)) + 0.3).astype("float32")
INITIAL = [_rng.normal(size=(FEATURES, 1)).astype("float32"), np.zeros(1, "float32")]


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH, drop_remainder=True)


def linear_model():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.set_weights(INITIAL)
    return model


def inner_optimizer():
    return keras.optimizers.SGD(INNER_LR, momentum=INNER_MOMENTUM)


def outer_optimizer(kind):
    return None if kind is None else local_sync_lib.diloco_outer_optimizer(OUTER_LR, OUTER_MOMENTUM)


def numpy_local_training(sync_every, diloco, epochs=EPOCHS, replicas=2):
    """The weights `[kernel, bias]` after local SGD / DiLoCo, simulated in NumPy."""
    features = np.concatenate([X, np.ones((len(X), 1), "float32")], axis=1).astype("float64")
    start = np.concatenate([INITIAL[0].ravel(), INITIAL[1]]).astype("float64")
    weights = [start.copy() for _ in range(replicas)]
    momenta = [np.zeros_like(start) for _ in range(replicas)]  # never averaged
    outer_momentum = np.zeros_like(start)
    anchor = start.copy()
    since_sync = 0

    def synchronise():
        nonlocal anchor, outer_momentum
        average = sum(weights) / replicas
        if diloco:
            # Outer Nesterov SGD on the pseudo-gradient (PyTorch's form, as the paper).
            pseudo_gradient = anchor - average
            outer_momentum = OUTER_MOMENTUM * outer_momentum + pseudo_gradient
            average = anchor - OUTER_LR * (pseudo_gradient + OUTER_MOMENTUM * outer_momentum)
        anchor = average.copy()
        for replica in range(replicas):
            weights[replica] = average.copy()

    share = GLOBAL_BATCH // replicas
    for _ in range(epochs):
        for step in range(STEPS_PER_EPOCH):
            for replica in range(replicas):
                rows = slice(step * GLOBAL_BATCH + replica * share,
                             step * GLOBAL_BATCH + (replica + 1) * share)
                error = features[rows] @ weights[replica] - Y[rows, 0]
                gradient = 2.0 * features[rows].T @ error / share
                momenta[replica] = INNER_MOMENTUM * momenta[replica] - INNER_LR * gradient
                weights[replica] = weights[replica] + momenta[replica]
            since_sync += 1
            if since_sync == sync_every:
                synchronise()
                since_sync = 0
        if since_sync:  # an epoch ends a window
            synchronise()
            since_sync = 0
    return [weights[0][:-1].reshape(FEATURES, 1), weights[0][-1:]]


def fit(strategy, sync_every, kind, epochs=EPOCHS, callbacks=(), **fit_kwargs):
    with strategy.scope():
        model = linear_model()
        tfdp.compile(model, optimizer=inner_optimizer(), loss="mse", sync_every=sync_every,
                     outer_optimizer=outer_optimizer(kind))
    model.fit(dataset(), epochs=epochs, verbose=0, callbacks=list(callbacks), **fit_kwargs)
    return model


def train(strategy, sync_every, kind, model_dir=None, steps=EPOCHS * STEPS_PER_EPOCH,
          checkpoint_every=None):
    with strategy.scope():
        model = linear_model()
        optimizer = inner_optimizer()
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                           batch=BatchConfig.from_global(GLOBAL_BATCH, 2), model_dir=model_dir,
                           checkpoint_every=checkpoint_every, sync_every=sync_every,
                           outer_optimizer=outer_optimizer(kind))
    trainer.train(dataset(), steps=steps)
    return model, trainer


def replica_copies(strategy, model):
    """Each weight's value on every replica: `[weight][replica]`."""
    return [[t.numpy() for t in strategy.experimental_local_results(getattr(v, "value", v))]
            for v in model.weights]


def assert_weights(model, expected, tolerance=TOLERANCE):
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


CASES = [(2, None), (3, "diloco"), (1, "diloco"), (4, None)]


@pytest.mark.slow
@pytest.mark.parametrize("sync_every,kind", CASES)
def test_fit_equals_numpy_simulation(two_replicas, sync_every, kind):
    model = fit(two_replicas, sync_every, kind)
    assert_weights(model, numpy_local_training(sync_every, kind is not None))
    for copies in replica_copies(two_replicas, model):
        np.testing.assert_array_equal(copies[0], copies[1])


@pytest.mark.slow
@pytest.mark.parametrize("sync_every,kind", CASES[:2])
def test_trainer_equals_numpy_simulation(two_replicas, sync_every, kind):
    model, _ = train(two_replicas, sync_every, kind)
    assert_weights(model, numpy_local_training(sync_every, kind is not None))


@pytest.mark.slow
def test_diloco_on_one_device_equals_numpy_simulation():
    """No strategy: Keras builds the optimizer while tracing the step (the outer one too)."""
    model = fit(tf.distribute.get_strategy(), 3, "diloco")
    assert_weights(model, numpy_local_training(3, True, replicas=1))


@pytest.mark.slow
def test_sync_every_1_is_synchronous_training(two_replicas):
    """`sync_every=1` without an outer optimizer takes the synchronous path: the same weights, bit for bit."""
    local = fit(two_replicas, 1, None)
    with two_replicas.scope():
        plain = linear_model()
        tfdp.compile(plain, optimizer=inner_optimizer(), loss="mse")
    plain.fit(dataset(), epochs=EPOCHS, verbose=0)
    for a, b in zip(local.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not local.optimizer.steps_locally


@pytest.mark.slow
def test_replicas_drift_between_synchronisations(two_replicas):
    """Within a window every replica holds its own weights; an epoch's end makes them equal."""
    seen = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen[batch] = replica_copies(two_replicas, self.model)

    model = fit(two_replicas, 100, None, epochs=1, callbacks=[Record()])
    kernel_0, kernel_1 = seen[0][0]
    assert np.abs(kernel_0 - kernel_1).max() > 1e-3
    last = seen[STEPS_PER_EPOCH - 1]  # the sync runs before the user's callbacks
    np.testing.assert_array_equal(last[0][0], last[0][1])
    assert int(model.optimizer.local_sync.steps_since_sync.numpy()) == 0


def _mse(weights):
    return float(np.mean((X.astype("float64") @ weights[0] + weights[1] - Y) ** 2))


@pytest.mark.slow
@pytest.mark.parametrize("sync_every,kind,validation_freq", [(100, None, 1), (3, "diloco", 2)])
def test_validation_sees_synchronised_weights(two_replicas, sync_every, kind, validation_freq):
    """`fit` validates through `model.evaluate`, which ends the window first.

    On unsynchronised weights each replica would evaluate its own copy; the
    validation loss is the loss of the simulated synchronised weights.
    """
    model = fit(two_replicas, sync_every, kind, validation_data=dataset(),
                validation_freq=validation_freq)
    validated = [epoch for epoch in range(1, EPOCHS + 1) if epoch % validation_freq == 0]
    want = [_mse(numpy_local_training(sync_every, kind is not None, epochs=epoch))
            for epoch in validated]
    np.testing.assert_allclose(model.history.history["val_loss"], want, rtol=TOLERANCE)
    assert_weights(model, numpy_local_training(sync_every, kind is not None))
    assert float(model.evaluate(dataset(), verbose=0)) == pytest.approx(want[-1], rel=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("sync_every,kind,windows", [(3, None, 2), (2, "diloco", 3), (5, None, 1)])
def test_one_weight_all_reduce_per_window_and_none_between(sync_every, kind, windows):
    """Counted at run time over one epoch of 5 steps: one all-reduce of all weights per window.

    With the weights, each replica's request to stop (one float32) rides in it.
    """
    strategy, (all_reduces, values, all_gathers) = strategy_testing.measuring_strategy(2)
    fit(strategy, sync_every, kind, epochs=1)
    assert int(all_reduces.numpy()) == windows
    assert int(values.numpy()) == windows * (FEATURES + 1 + 1)
    assert int(all_gathers.numpy()) == 0


@pytest.mark.slow
def test_sync_is_not_converted_by_autograph_as_the_steps_are(two_replicas, monkeypatch):
    """A converted function runs from AutoGraph's generated copy, not from its own file.

    Converted, the synchronisation function made AutoGraph re-parse its
    whole call tree (the all-reduce, the outer optimizer) on its first trace.
    """
    import inspect

    files = []
    values = local_sync_lib.LocalSync._values  # pylint: disable=protected-access

    def recording_values(self):
        files.append(inspect.currentframe().f_code.co_filename)
        return values(self)

    monkeypatch.setattr(local_sync_lib.LocalSync, "_values", recording_values)
    model = fit(two_replicas, 100, "diloco", epochs=1)  # one sync, by sync_pending
    assert len(files) >= 2  # traced: in the train step and in sync_pending, on each replica
    assert set(files) == {__file__}, files
    assert int(model.optimizer.local_sync.steps_since_sync.numpy()) == 0


@pytest.mark.slow
def test_trainer_resumes_exactly_from_a_checkpoint_inside_a_window(two_replicas, tmp_path):
    """A checkpoint inside a window saves every replica's weights, so a run stopped there and
    resumed equals one that went on.

    Plain SGD inside (no per-replica slots); DiLoCo's anchors, counter and
    outer momentum are equal on every replica and checkpointed.
    """
    global inner_optimizer
    saved = inner_optimizer
    inner_optimizer = lambda: keras.optimizers.SGD(INNER_LR)  # noqa: E731
    try:
        straight, _ = train(two_replicas, 4, "diloco", model_dir=str(tmp_path / "a"),
                            checkpoint_every=3)
        train(two_replicas, 4, "diloco", model_dir=str(tmp_path / "b"), steps=3,
              checkpoint_every=3)
        resumed, trainer = train(two_replicas, 4, "diloco", model_dir=str(tmp_path / "b"),
                                 checkpoint_every=3)
    finally:
        inner_optimizer = saved
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH
    outer = trainer.optimizer.outer_optimizer
    assert int(outer.iterations.numpy()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", [None, "diloco"])
def test_trainer_checkpoints_do_not_change_the_trajectory(two_replicas, tmp_path, kind):
    """Saves inside windows (every 3 steps, sync_every=4) end no window (issue 33, finding 1).

    With momentum (per-replica slots): a run saving at steps 3, 6 and 9,
    and a run stopped after its save at step 3 (mid-window, the replicas'
    weights apart) and resumed, both equal the simulation without saves; the
    resumed run equals the uninterrupted one bit for bit.
    """
    want = numpy_local_training(4, kind is not None)
    without, _ = train(two_replicas, 4, kind)
    saving, _ = train(two_replicas, 4, kind, model_dir=str(tmp_path / "a"), checkpoint_every=3)
    train(two_replicas, 4, kind, model_dir=str(tmp_path / "b"), steps=3, checkpoint_every=3)
    resumed, trainer = train(two_replicas, 4, kind, model_dir=str(tmp_path / "b"),
                             checkpoint_every=3)
    for model in (without, saving, resumed):
        assert_weights(model, want)
    for a, b in zip(saving.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH


class _Interrupted(Exception):
    pass


class _InterruptAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self._steps, self._seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self._seen == self._steps:
            raise _Interrupted()


@pytest.mark.slow
def test_fit_backups_inside_a_window_do_not_change_the_trajectory(two_replicas, tmp_path):
    """tfdp's BackupAndRestore(save_freq=3) with sync_every=4: no window ends at a save.

    A run stopped after step 7 (its last backup at step 6, one step into a
    window) and resumed ends as the simulation without saves, and as a run
    that backed up without stopping, bit for bit.
    """
    want = numpy_local_training(4, True)

    def run(directory, *extra):
        with two_replicas.scope():
            model = linear_model()
            tfdp.compile(model, optimizer=inner_optimizer(), loss="mse", sync_every=4,
                         outer_optimizer=outer_optimizer("diloco"))
        backup = tfdp.callbacks.BackupAndRestore(str(directory), save_freq=3)
        model.fit(backup.wrap(lambda epoch: dataset()), epochs=EPOCHS, verbose=0,
                  callbacks=[backup, *extra])
        return model

    straight = run(tmp_path / "a")
    with pytest.raises(_Interrupted):
        run(tmp_path / "b", _InterruptAfter(7))
    resumed = run(tmp_path / "b")
    assert_weights(straight, want)
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("callback", [
    lambda path: keras.callbacks.ModelCheckpoint(str(path / "m.keras"), save_freq=2),
    lambda path: keras.callbacks.BackupAndRestore(str(path / "b"), save_freq=2),
], ids=["ModelCheckpoint", "BackupAndRestore"])
def test_keras_savers_mid_epoch_are_refused_with_local_steps(two_replicas, tmp_path, callback):
    """They would save the first replica's unsynchronised weights; the error names the way out."""
    callback = callback(tmp_path)
    with two_replicas.scope():
        model = linear_model()
        tfdp.compile(model, optimizer=inner_optimizer(), loss="mse", sync_every=4)
    name = type(callback).__name__
    with pytest.raises(ValueError, match=rf"keras.callbacks.{name}\(save_freq=2\).*"
                                         r"tfdp.callbacks.BackupAndRestore"):
        model.fit(dataset(), epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 0  # refused before any step


STOPPED_AT_SYNC = "stopped on every worker at the next synchronisation"


def _nan_on_replica_1(batches):
    """`dataset()` with NaN features in the second replica's half of the given batches."""
    x = X.copy()
    for b in batches:
        x[b * GLOBAL_BATCH + GLOBAL_BATCH // 2:(b + 1) * GLOBAL_BATCH] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, Y)).batch(GLOBAL_BATCH, drop_remainder=True)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "trainer"])
def test_the_nonfinite_limit_stops_every_worker_at_a_synchronisation(two_replicas, loop):
    """Issue 33, finding 2: under local steps each replica skips on its own, so no worker may
    raise alone (the others would wait in the next synchronisation's all-reduce).

    NaN on replica 1 in steps 2 and 3 reaches max_consecutive_nonfinite=2 at
    step 3, inside a window of sync_every=4. The request to stop rides in the
    all-reduce of step 4, and training stops there, on every replica alike:
    the weights are synchronised and the window is closed when the error is
    raised.
    """
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    with two_replicas.scope():
        model = linear_model()
        optimizer = inner_optimizer()
    if loop == "fit":
        with two_replicas.scope():
            tfdp.compile(model, optimizer=optimizer, loss="mse", sync_every=4,
                         max_consecutive_nonfinite=2)
        guard = model.optimizer
        with pytest.raises(nonfinite_lib.NonFiniteError, match=STOPPED_AT_SYNC):
            model.fit(_nan_on_replica_1([1, 2]), epochs=1, verbose=0, callbacks=[Count()])
    else:
        trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=two_replicas,
                               batch=BatchConfig.from_global(GLOBAL_BATCH, 2), sync_every=4,
                               max_consecutive_nonfinite=2)
        guard = trainer.optimizer
        with pytest.raises(nonfinite_lib.NonFiniteError, match=STOPPED_AT_SYNC):
            trainer.train(_nan_on_replica_1([1, 2]), steps=STEPS_PER_EPOCH)
    assert int(guard.local_sync.steps_since_sync.numpy()) == 0
    assert int(guard.local_sync.stopped.numpy()) == 1
    for copies in replica_copies(two_replicas, model):
        np.testing.assert_array_equal(copies[0], copies[1])
    if loop == "fit":
        assert seen == [0, 1, 2]  # not stopped alone at step 3; step 4's batch end never ran


@pytest.mark.slow
def test_a_stop_agreed_at_the_last_synchronisation_raises_at_the_end_of_training(two_replicas):
    """The limit reached in a window that only the end of `train` closes: raised there."""
    with two_replicas.scope():
        model = linear_model()
        optimizer = inner_optimizer()
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=two_replicas,
                           batch=BatchConfig.from_global(GLOBAL_BATCH, 2), sync_every=4,
                           max_consecutive_nonfinite=2)
    with pytest.raises(nonfinite_lib.NonFiniteError, match=STOPPED_AT_SYNC):
        trainer.train(_nan_on_replica_1([1, 2]), steps=3)
    assert int(trainer.optimizer.local_sync.stopped.numpy()) == 1


def test_optimizer_config_round_trip():
    guard = nonfinite_lib.NonFiniteGuard(
        keras.optimizers.SGD(0.1),
        local_sync=local_sync_lib.LocalSync(4, local_sync_lib.diloco_outer_optimizer()),
    )
    again = nonfinite_lib.NonFiniteGuard.from_config(guard.get_config())
    assert again.local_sync.sync_every == 4
    outer = again.local_sync.outer_optimizer
    assert isinstance(outer, keras.optimizers.SGD) and outer.nesterov
    assert float(outer.learning_rate) == pytest.approx(0.7)


@pytest.mark.parametrize("sync_every", [0, -2, 1.5, "4", True])
def test_sync_every_must_be_a_positive_integer(two_replicas, sync_every):
    with two_replicas.scope(), pytest.raises(ValueError, match="`sync_every` must be a positive"):
        tfdp.compile(linear_model(), optimizer="sgd", loss="mse", sync_every=sync_every)


@pytest.mark.parametrize("compression", ["bfloat16", "powersgd"])
def test_compression_with_local_steps_is_refused(two_replicas, compression):
    if compression == "powersgd":
        compression = tfdp.compression.PowerSGD(rank=2)
    with two_replicas.scope(), pytest.raises(ValueError, match="nothing to compress"):
        tfdp.compile(linear_model(), optimizer="sgd", loss="mse", sync_every=4,
                     gradient_compression=compression)


def test_local_steps_need_the_wrapper(two_replicas):
    with two_replicas.scope(), pytest.raises(ValueError, match="nonfinite=None cannot be combined with sync_every=4"):
        tfdp.compile(linear_model(), optimizer="sgd", loss="mse", sync_every=4, nonfinite=None)
    with two_replicas.scope():
        model = linear_model()
        optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="nonfinite=None cannot be combined with outer_optimizer"):
        tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=two_replicas,
                     batch=BatchConfig.from_global(GLOBAL_BATCH, 2), nonfinite=None,
                     outer_optimizer="sgd")


def test_a_model_with_its_own_train_step_is_refused(two_replicas):
    class Custom(keras.Sequential):
        def train_step(self, data):  # pragma: no cover - never traced
            return super().train_step(data)

    with two_replicas.scope():
        model = Custom([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        with pytest.raises(ValueError, match="cannot take local steps"):
            tfdp.compile(model, optimizer="sgd", loss="mse", sync_every=2,
                         loss_normalization="per_replica")
