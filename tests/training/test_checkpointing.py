"""ChiefCheckpointManager: bad checkpoints are refused untouched; partial saves are ignored."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.training import checkpointing


def _objects(units=3):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _manager(directory, units=3):
    model, optimizer = _objects(units)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    return model, checkpointing.ChiefCheckpointManager(checkpoint, str(directory), is_chief=True)


def _snapshot(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


@pytest.fixture
def saved(tmp_path):
    model, manager = _manager(tmp_path)
    manager.save(1)
    model.layers[0].kernel.assign(model.layers[0].kernel + 1.0)
    manager.save(2)
    return tmp_path, [w.copy() for w in model.get_weights()]


def test_restores_the_newest_complete_checkpoint(saved):
    directory, weights = saved
    # What a kill during a save leaves: the data is written into a temporary
    # directory and the `checkpoint` state file is updated last.
    (directory / "ckpt-3_temp").mkdir()
    (directory / "ckpt-3_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"xx")
    model, manager = _manager(directory)
    assert manager.restore_latest().endswith("ckpt-2")
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


def test_a_truncated_checkpoint_is_refused_naming_it_and_the_fix(saved):
    directory, _ = saved
    data = next(directory.glob("ckpt-2.data-*"))
    data.write_bytes(data.read_bytes()[:20])
    before = _snapshot(directory)
    _, manager = _manager(directory)
    with pytest.raises(ValueError, match=r"ckpt-2 cannot be read: it is damaged or incomplete"):
        manager.restore_latest()
    assert _snapshot(directory) == before


def test_a_checkpoint_of_another_model_is_refused_untouched(saved):
    directory, _ = saved
    before = _snapshot(directory)
    _, manager = _manager(directory, units=5)
    with pytest.raises(ValueError, match="does not match this model and optimizer.*Nothing was"):
        manager.restore_latest()
    assert _snapshot(directory) == before


def _dropout_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dropout(0.5), keras.layers.Dense(1)])


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))).batch(8)


@pytest.mark.slow
def test_dropout_draws_resume_where_they_stopped(tmp_path):
    """Keras keeps Dropout's generator state outside TF's checkpoints; tfdp saves it too."""
    import tfdp

    def run(model_dir, steps):
        model = _dropout_model()
        trainer = tfdp.Trainer(model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                               strategy=tf.distribute.get_strategy(),
                               batch=tfdp.BatchConfig(8, 1), model_dir=model_dir,
                               checkpoint_every=3, steps_per_loop=3)
        trainer.train(_data().repeat(), steps=steps)
        return model

    straight = run(str(tmp_path / "straight"), 6)
    run(str(tmp_path / "resumed"), 3)
    resumed = run(str(tmp_path / "resumed"), 6)
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert checkpointing.random_state(straight)
    assert not checkpointing.random_state(_objects()[0])  # no generator: layout unchanged


@pytest.mark.slow
def test_dropout_draws_resume_where_they_stopped_in_fit(tmp_path):
    import tfdp

    class Crash(Exception):
        pass

    class CrashAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) >= 4:
                raise Crash()

    def run(backup_dir, callbacks=()):
        model = _dropout_model()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.05), loss="mse")
        backup = tfdp.callbacks.BackupAndRestore(str(backup_dir), save_freq=2)
        model.fit(backup.wrap(lambda epoch: _data()), epochs=2, verbose=0,
                  callbacks=[backup, *callbacks])
        return model

    straight = run(tmp_path / "straight")
    with pytest.raises(Crash):
        run(tmp_path / "resumed", [CrashAfter()])
    resumed = run(tmp_path / "resumed")
    assert int(resumed.optimizer.iterations.numpy()) == 12
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
