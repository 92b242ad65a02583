"""tfdp._upstream.keras_fit_resume against the installed Keras.

Two kinds of test: each Keras internal the module relies on still behaves as
it did (so a Keras upgrade that moves one fails here, not in a user's
resumed run), and the reasons the module exists still hold (so we learn when
upstream no longer needs it).
"""

from __future__ import annotations

import json

import keras
import pytest

import backup_testing as bt
from tfdp._upstream import keras_fit_resume
from tfdp.training import batch as batch_lib
from tfdp.training import input_position
from keras.src.trainers.data_adapters import data_adapter


class _Interrupted(Exception):
    pass


class _Batches(keras.callbacks.Callback):
    """Records (epoch, batch) for every on_train_batch_end; can crash at a step."""

    def __init__(self, crash_at=None):
        super().__init__()
        self.crash_at = crash_at
        self.batches = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch))
        if self.crash_at and len(self.batches) >= self.crash_at:
            raise _Interrupted()


def _model():
    return bt.compile_model(bt.build_model())


@pytest.mark.slow
def test_keras_backup_and_restore_still_restarts_the_epoch_at_batch_0(tmp_path):
    """Why tfdp has its own callback. If this fails, Keras resumes mid-epoch itself."""
    dataset = bt.dataset_for_epoch(0)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2, delete_checkpoint=False)
    with pytest.raises(_Interrupted):
        _model().fit(dataset, epochs=bt.EPOCHS, verbose=0, shuffle=False,
                     callbacks=[backup, _Batches(crash_at=9)])
    metadata = json.loads((tmp_path / "training_metadata.json").read_text())
    assert metadata == {"epoch": 1, "batch": 1}  # it knows 2 batches of epoch 1 were done

    resumed = _Batches()
    _model().fit(dataset, epochs=bt.EPOCHS, verbose=0, shuffle=False,
                 callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2),
                            resumed])
    # 18 - 8 = 10 batches remained; Keras trains 12: batches 0-1 of epoch 1 twice.
    assert len(resumed.batches) == 12
    assert resumed.batches[0] == (1, 0)


def test_keras_data_adapters_have_no_iterator_state_hook_yet():
    """keras-team/keras#22490 proposed get/set_iterator_state; if it lands, use it."""
    assert not hasattr(data_adapter.DataAdapter, "set_iterator_state")


@pytest.mark.slow
def test_without_the_patch_every_epoch_starts_at_batch_0():
    """`EpochIterator` numbers steps from 0 and ignores where an epoch should start."""
    model = _model()
    position = (0, 2)
    epoch_input = keras_fit_resume.EpochInput(
        bt.dataset_for_epoch, steps_per_epoch=bt.STEPS_PER_EPOCH, position=lambda: position,
        num_batches=batch_lib.num_batches, start_at=input_position.start_at_batch)
    recorder = _Batches()
    keras_fit_resume.install()
    assert keras_fit_resume.uninstall()
    try:
        model.fit(epoch_input, epochs=1, verbose=0, callbacks=[recorder])
    finally:
        assert keras_fit_resume.install()
    assert [b for _, b in recorder.batches] == list(range(bt.STEPS_PER_EPOCH))

    recorder = _Batches()
    model.fit(epoch_input, epochs=1, verbose=0, callbacks=[recorder])
    assert [b for _, b in recorder.batches] == list(range(2, bt.STEPS_PER_EPOCH))


def test_fit_starts_at_the_initial_epoch_a_callback_sets():
    class SetsInitialEpoch(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            keras_fit_resume.set_initial_epoch(self.model, 2)

    model = _model()
    recorder = _Batches()
    model.fit(bt.dataset_for_epoch(0), epochs=3, verbose=0, shuffle=False,
              callbacks=[SetsInitialEpoch(), recorder])
    assert {epoch for epoch, _ in recorder.batches} == {2}
    # Keras never resets it: without clear_initial_epoch, the next fit would skip epochs.
    recorder = _Batches()
    model.fit(bt.dataset_for_epoch(0), epochs=1, verbose=0, shuffle=False, callbacks=[recorder])
    assert recorder.batches == []
    keras_fit_resume.clear_initial_epoch(model)
    model.fit(bt.dataset_for_epoch(0), epochs=1, verbose=0, shuffle=False, callbacks=[recorder])
    assert {epoch for epoch, _ in recorder.batches} == {0}


def test_install_is_idempotent_and_version_gated():
    assert keras_fit_resume.install() and keras_fit_resume.install()
    assert keras_fit_resume.is_supported()
    assert keras_fit_resume.is_supported("3.15.1") and keras_fit_resume.is_supported("3.0.0")
    assert not keras_fit_resume.is_supported("3.16.0")
    with pytest.raises(ValueError, match=r"`keras_version` must look like 'MAJOR.MINOR"):
        keras_fit_resume.is_supported("three")


def test_backup_and_restore_refuses_mid_epoch_resume_on_a_keras_it_does_not_patch(
        monkeypatch, tmp_path):
    """Outside KNOWN_KERAS_RANGE nothing is patched: a mid-epoch resume would repeat batches."""
    from tfdp.callbacks import BackupAndRestore

    monkeypatch.setattr(keras, "__version__", "3.16.0")  # what _versions reads
    assert keras_fit_resume.install() is False
    for make in (lambda: BackupAndRestore(str(tmp_path / "a"), save_freq=2),
                 lambda: BackupAndRestore(str(tmp_path / "b")).wrap(bt.dataset_for_epoch)):
        with pytest.raises(RuntimeError) as refused:
            make()
        said = str(refused.value)
        for expected in ("Keras 3.16.0", "keras-team/keras-hub#204", "save_freq='epoch'",
                         "tfdp.Trainer", "keras<=3.15"):
            assert expected in said, said
    # What needs no patch still works: an epoch-level backup of fit's own input.
    BackupAndRestore(str(tmp_path / "c"), save_freq="epoch")
    monkeypatch.undo()
    assert keras_fit_resume.install()


@pytest.mark.slow
def test_fit_class_weight_reaches_a_wrapped_input_as_keras_applies_it(tmp_path):
    """Keras drops `class_weight` for a DataAdapter input; the patch hands it over."""
    import numpy as np
    from tfdp.callbacks import BackupAndRestore

    class_weight = {0: 0.0, 1: 3.0, 2: 1.0}
    results = []
    for wrapped in (False, True):
        model = bt.compile_model(bt.build_model())
        callbacks, x = [], bt.dataset_for_epoch(0)
        if wrapped:
            backup = BackupAndRestore(str(tmp_path / "backup"))
            x, callbacks = backup.wrap(lambda epoch: bt.dataset_for_epoch(0)), [backup]
        history = model.fit(x, epochs=2, class_weight=class_weight, callbacks=callbacks,
                            verbose=0, shuffle=False)
        results.append(([w.numpy() for w in model.weights], history.history["loss"]))
    (keras_weights, keras_loss), (wrapped_weights, wrapped_loss) = results
    for got, want in zip(wrapped_weights, keras_weights):
        np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(wrapped_loss, keras_loss, rtol=1e-6)
    # Distributed epochs cannot be mapped: refused, not ignored.
    import tfdp

    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        model = bt.compile_model(bt.build_model())
    backup = BackupAndRestore(str(tmp_path / "distributed"))
    x = backup.wrap(lambda epoch: strategy.experimental_distribute_dataset(bt.dataset_for_epoch(0)))
    with pytest.raises(ValueError, match=r"class_weight=.*cannot be applied.*sample weights"):
        model.fit(x, epochs=1, class_weight=class_weight, callbacks=[backup], verbose=0)
