"""Per-replica state in checkpoints: error memories and local slots resume exactly.

On 2 logical CPU replicas a `tfdp.Trainer` stopped at a checkpoint and
resumed must end with the weights of an uninterrupted run, bit for bit,
with Top-K's error memories and with local SGD's per-replica momentum:
both differ per replica, so the chief's one copy is not enough. Without the
per-replica files the resumed run differs (the test can fail), and files
written by another layout are refused.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import replica_state
from tfdp.training.batch import BatchConfig

GLOBAL_BATCH = 16
STEPS = 6
STOP_AT = 3


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def dataset():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
    y = rng.integers(0, 3, GLOBAL_BATCH * STEPS)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)


def trainer(strategy, model_dir, **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(10, activation="tanh"),
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return tfdp.Trainer(
        model, optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), strategy=strategy,
        batch=BatchConfig.from_global(GLOBAL_BATCH, 2), model_dir=str(model_dir),
        checkpoint_every=STOP_AT, **kwargs)


def run(strategy, model_dir, steps, **kwargs):
    t = trainer(strategy, model_dir, **kwargs)
    t.train(dataset(), steps=steps)
    return t


METHODS = {
    "topk": lambda: dict(gradient_compression=tfdp.compression.TopK(fraction=0.2)),
    "powersgd": lambda: dict(gradient_compression=tfdp.compression.PowerSGD(rank=1)),
    "local_sgd": lambda: dict(sync_every=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_resume_at_a_checkpoint_equals_an_uninterrupted_run(two_replicas, tmp_path, method):
    straight = run(two_replicas, tmp_path / "straight", STEPS, **METHODS[method]())
    run(two_replicas, tmp_path / "resumed", STOP_AT, **METHODS[method]())
    files = os.listdir(tmp_path / "resumed" / replica_state.SUBDIRECTORY / f"ckpt-{STOP_AT}")
    assert files == ["worker-0-of-1.npz"]
    resumed = run(two_replicas, tmp_path / "resumed", STEPS, **METHODS[method]())
    assert resumed.global_step == STEPS
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_without_the_replica_files_the_resumed_run_differs(two_replicas, tmp_path):
    """The check above can fail: the chief's copy alone does not resume Top-K exactly."""
    straight = run(two_replicas, tmp_path / "straight", STEPS, **METHODS["topk"]())
    run(two_replicas, tmp_path / "resumed", STOP_AT, **METHODS["topk"]())
    tf.io.gfile.rmtree(str(tmp_path / "resumed" / replica_state.SUBDIRECTORY))
    resumed = run(two_replicas, tmp_path / "resumed", STEPS, **METHODS["topk"]())
    difference = max(np.abs(a - b).max() for a, b in zip(straight.model.get_weights(),
                                                          resumed.model.get_weights()))
    assert difference > 1e-4


def test_old_steps_are_dropped_with_the_checkpoints(two_replicas, tmp_path):
    t = trainer(two_replicas, tmp_path, max_to_keep=1, **METHODS["topk"]())
    t.train(dataset(), steps=STEPS)
    assert os.listdir(tmp_path / replica_state.SUBDIRECTORY) == [f"ckpt-{STEPS}"]


@pytest.mark.slow
def test_files_of_another_layout_are_refused(two_replicas, tmp_path):
    run(two_replicas, tmp_path, STOP_AT, **METHODS["topk"]())
    step_dir = tmp_path / replica_state.SUBDIRECTORY / f"ckpt-{STOP_AT}"
    (step_dir / "worker-0-of-1.npz").rename(step_dir / "worker-0-of-2.npz")
    with pytest.raises(ValueError, match="written by other workers .*worker-0-of-2.npz"):
        run(two_replicas, tmp_path, STEPS, **METHODS["topk"]())
    (step_dir / "worker-0-of-2.npz").rename(step_dir / "worker-0-of-1.npz")
    with pytest.raises(ValueError, match="holds per-replica state for 2 replica.*this run has 2 and 4"):
        run(two_replicas, tmp_path, STEPS, **METHODS["powersgd"]())


@pytest.mark.slow
def test_backup_and_restore_deletes_the_replica_files(two_replicas, tmp_path):
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     gradient_compression=tfdp.compression.TopK(fraction=0.2))
    backup = tfdp.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.extend(tf.io.gfile.glob(str(tmp_path / "backup" / "replica_state" / "*" / "*")))

    model.fit(backup.wrap(lambda epoch: dataset()), epochs=1, verbose=0,
              callbacks=[backup, Look()])
    assert any(path.endswith("worker-0-of-1.npz") for path in seen)
    assert not (tmp_path / "backup").exists()
