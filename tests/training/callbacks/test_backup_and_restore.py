"""tfdp.callbacks.BackupAndRestore: exact resume, SIGTERM, chief-only writes, bad input.

Reference checks: an interrupted run, resumed by a fresh model and callback,
must end with the weights and `optimizer.iterations` of a run that never
stopped (plain Keras `fit`, epoch by epoch, on the same per-epoch datasets),
and the model must have trained on every example exactly once per epoch
(`backup_testing.Recorder` sees the ids inside the train step).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import backup_testing as bt
import tfdp
from tfdp.callbacks import PREEMPTION_EXIT_CODE, BackupAndRestore


class Interrupted(Exception):
    """Stands for a crash: fit stops without on_train_end."""


class InterruptAt(keras.callbacks.Callback):
    """Raises `Interrupted` (or sends SIGTERM) once `step` optimizer steps are done."""

    def __init__(self, step: int, *, sigterm: bool = False):
        super().__init__()
        self.step = step
        self.sigterm = sigterm

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.step:
            if self.sigterm:
                self.sigterm = False
                assert signal.getsignal(signal.SIGTERM) not in (None, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise Interrupted()


@pytest.fixture(autouse=True)
def _keep_sigterm_handler():
    """An interrupted fit may leave the callback's SIGTERM handler behind."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


CONFIGS = {
    "default": dict(replicas=1, accum_steps=1, steps_per_execution=1),
    "mirrored2-accum2-spe2": dict(replicas=2, accum_steps=2, steps_per_execution=2),
    # What pipelines.make_dataset returns: an already distributed dataset.
    "mirrored2-distributed": dict(replicas=2, accum_steps=1, steps_per_execution=2,
                                  distributed=True),
}


def _strategy(replicas: int):
    return tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1 else tfdp.make_strategy("default")


def _model(strategy, recorder=None, *, seed=11, accum_steps=1, steps_per_execution=1):
    with strategy.scope():
        model = bt.build_model(recorder, seed=seed)
        bt.compile_model(model, accum_steps=accum_steps, steps_per_execution=steps_per_execution)
    return model


def _assert_weights_equal(got, want, atol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=0)


def _assert_each_example_once_per_epoch(seen, epochs=range(bt.EPOCHS)):
    by_epoch = bt.counts(seen)
    assert sorted(by_epoch) == list(epochs)
    for epoch in epochs:
        twice = {i: n for i, n in by_epoch[epoch].items() if n != 1}
        assert not twice, f"epoch {epoch}: examples seen more than once: {twice}"
        assert sorted(by_epoch[epoch]) == list(range(bt.NUM_EXAMPLES)), f"epoch {epoch}"


def _snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _progress(directory: Path) -> dict:
    path = tf.train.latest_checkpoint(str(directory))
    names = ("epoch", "batch", "step", "steps_per_epoch")
    values = {n: int(tf.train.load_variable(path, f"progress/{n}/.ATTRIBUTES/VARIABLE_VALUE"))
              for n in names}
    return {"path": os.path.basename(path), **values}


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_resumes_mid_epoch_at_the_exact_step(config, tmp_path):
    options = CONFIGS[config]
    strategy = _strategy(options["replicas"])
    kwargs = dict(accum_steps=options["accum_steps"],
                  steps_per_execution=options["steps_per_execution"])
    want, want_steps = bt.reference_weights(strategy, **kwargs)
    assert want_steps == bt.TOTAL_STEPS
    backup_dir = tmp_path / "backup"
    dataset_for_epoch = bt.dataset_for_epoch
    if options.get("distributed"):
        def dataset_for_epoch(epoch):
            return strategy.experimental_distribute_dataset(bt.dataset_for_epoch(epoch))

    # Run 1: a backup every 4 steps; crash after step 10 (epoch 1, batch 4).
    first = bt.Recorder()
    model = _model(strategy, first, **kwargs)
    backup = BackupAndRestore(backup_dir, save_freq=4)
    with pytest.raises(Interrupted):
        model.fit(backup.wrap(dataset_for_epoch), epochs=bt.EPOCHS, verbose=0,
                  callbacks=[bt.epoch_callback(first), backup, InterruptAt(10)])
    assert int(model.optimizer.iterations.numpy()) == 10
    saved = _progress(backup_dir)
    assert saved == {"path": "ckpt-8", "epoch": 1, "batch": 2, "step": 8,
                     "steps_per_epoch": bt.STEPS_PER_EPOCH}

    # Run 2: a fresh model (other initial weights) and callback, as after a restart.
    second = bt.Recorder()
    model = _model(strategy, second, seed=5, **kwargs)
    backup = BackupAndRestore(backup_dir, save_freq=4)
    history = model.fit(backup.wrap(dataset_for_epoch), epochs=bt.EPOCHS, verbose=0,
                        callbacks=[bt.epoch_callback(second), backup])

    assert int(model.optimizer.iterations.numpy()) == bt.TOTAL_STEPS
    _assert_weights_equal(model.get_weights(), want)
    assert len(history.history["loss"]) == 2  # epochs 1 and 2
    # Epoch 1 restarts at batch 2: Keras is told batches 2..5, nothing before.
    k = options["steps_per_execution"]
    assert [b for e, b in second.batches if e == 1] == list(range(2 + k - 1, 6, k))
    resumed_epoch = [i for e, i in second.seen if e == 1]
    assert sorted(resumed_epoch) == sorted(bt.epoch_order(1)[2 * bt.GLOBAL_BATCH:])
    # Steps 9-10 of run 1 were lost with its model and trained again; the
    # state that survived saw every example exactly once per epoch.
    _assert_each_example_once_per_epoch(first.seen_until(8) + second.seen)
    assert not backup_dir.exists()


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_with_42(tmp_path):
    strategy = _strategy(1)
    want, _ = bt.reference_weights(strategy)
    backup_dir = tmp_path / "backup"
    before = signal.getsignal(signal.SIGTERM)

    first = bt.Recorder()
    model = _model(strategy, first)
    backup = BackupAndRestore(backup_dir)  # epoch backups; SIGTERM saves mid-epoch
    with pytest.raises(SystemExit) as exit_info:
        model.fit(backup.wrap(bt.dataset_for_epoch), epochs=bt.EPOCHS, verbose=0,
                  callbacks=[bt.epoch_callback(first), InterruptAt(7, sigterm=True), backup])
    assert exit_info.value.code == PREEMPTION_EXIT_CODE == 42
    assert signal.getsignal(signal.SIGTERM) is before  # handler put back before exiting
    assert int(model.optimizer.iterations.numpy()) == 7
    assert _progress(backup_dir) == {"path": "ckpt-7", "epoch": 1, "batch": 1, "step": 7,
                                     "steps_per_epoch": bt.STEPS_PER_EPOCH}

    second = bt.Recorder()
    model = _model(strategy, second, seed=5)
    backup = BackupAndRestore(backup_dir)
    model.fit(backup.wrap(bt.dataset_for_epoch), epochs=bt.EPOCHS, verbose=0,
              callbacks=[bt.epoch_callback(second), backup])
    assert int(model.optimizer.iterations.numpy()) == bt.TOTAL_STEPS
    _assert_weights_equal(model.get_weights(), want)
    # Nothing lost, nothing repeated: run 1's every step survived.
    _assert_each_example_once_per_epoch(first.seen + second.seen)
    assert not backup_dir.exists()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_plain_dataset_resumes_at_epoch_granularity(tmp_path):
    """Without wrap: epoch backups only, and SIGTERM mid-epoch keeps the last one."""
    strategy = _strategy(1)
    dataset = bt.dataset_for_epoch(0)  # the same order every epoch
    reference = _model(strategy)
    reference.fit(dataset, epochs=bt.EPOCHS, verbose=0, shuffle=False)
    backup_dir = tmp_path / "backup"

    model = _model(strategy)
    backup = BackupAndRestore(backup_dir)
    with pytest.raises(SystemExit) as exit_info:
        model.fit(dataset, epochs=bt.EPOCHS, verbose=0, shuffle=False,
                  callbacks=[InterruptAt(8, sigterm=True), backup])
    assert exit_info.value.code == 42
    assert _progress(backup_dir) == {"path": "ckpt-6", "epoch": 1, "batch": 0, "step": 6,
                                     "steps_per_epoch": bt.STEPS_PER_EPOCH}

    model = _model(strategy, seed=5)
    history = model.fit(dataset, epochs=bt.EPOCHS, verbose=0, shuffle=False,
                        callbacks=[BackupAndRestore(backup_dir)])
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == bt.TOTAL_STEPS
    _assert_weights_equal(model.get_weights(), reference.get_weights())
    assert not backup_dir.exists()


# --- bad input ------------------------------------------------------------------


@pytest.mark.parametrize("save_freq", [0, -4, 2.5, True, "batch", None])
def test_invalid_save_freq_is_refused(save_freq, tmp_path):
    with pytest.raises(ValueError, match=r"`save_freq` must be 'epoch' or a positive"):
        BackupAndRestore(tmp_path, save_freq=save_freq)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backup_dir=""), "`backup_dir` must be a non-empty path"),
    (dict(backup_dir=None), "`backup_dir` must be a non-empty path"),
    (dict(backup_dir="b", exit_code=0), r"`exit_code` must be an integer in \[1, 255\]"),
    (dict(backup_dir="b", exit_code=256), r"Received: exit_code=256"),
])
def test_invalid_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BackupAndRestore(**kwargs)


def test_save_freq_must_be_a_multiple_of_steps_per_execution(tmp_path):
    model = _model(_strategy(1), steps_per_execution=4)
    backup = BackupAndRestore(tmp_path / "backup", save_freq=6)
    with pytest.raises(ValueError, match=r"multiple of the model's steps_per_execution \(4\).*"
                                         r"save_freq=4 or 8"):
        model.fit(backup.wrap(bt.dataset_for_epoch), epochs=1, callbacks=[backup], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert not (tmp_path / "backup").exists()


def test_batch_level_backups_need_the_wrapped_input(tmp_path):
    model = _model(_strategy(1))
    backup = BackupAndRestore(tmp_path / "backup", save_freq=2)
    with pytest.raises(ValueError, match=r"Pass x=backup.wrap\(...\), or use save_freq='epoch'"):
        model.fit(bt.dataset_for_epoch(0), epochs=1, callbacks=[backup], verbose=0,
                  shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 0


def _different_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((bt.FEATURES + 1,)), keras.layers.Dense(5),
                              keras.layers.Dense(bt.CLASSES)])
    return bt.compile_model(model)


@pytest.mark.parametrize("change, match", [
    ("model", r"holds a checkpoint \(ckpt-4\) that cannot be restored into this model and "
              r"optimizer: The checkpoint .* does not match"),
    ("batch_size", r"written with 6 steps per epoch; this fit has 4"),
    ("not_ours", r"holds a checkpoint \(ckpt-1\) that BackupAndRestore did not write"),
    ("truncated", r"holds a checkpoint \(ckpt-4\) that (cannot be read: it is damaged|"
                  r"cannot be restored .* damaged or incomplete)"),
])
def test_a_backup_of_another_run_is_refused_untouched(change, match, tmp_path):
    backup_dir = tmp_path / "backup"
    model = _model(_strategy(1))
    if change == "not_ours":  # e.g. a model_dir of tfdp.Trainer
        tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(backup_dir), 2).save()
    else:
        backup = BackupAndRestore(backup_dir, save_freq=2)
        with pytest.raises(Interrupted):
            model.fit(backup.wrap(bt.dataset_for_epoch), epochs=2, verbose=0,
                      callbacks=[backup, InterruptAt(4)])
    if change == "truncated":  # e.g. a disk that filled up
        data = next(backup_dir.glob("ckpt-4.data-*"))
        data.write_bytes(data.read_bytes()[:16])
    before = _snapshot(backup_dir)

    if change == "model":
        model, dataset_fn = _different_model(), bt.dataset_for_epoch
    else:
        model = _model(_strategy(1))
        batch = 12 if change == "batch_size" else bt.GLOBAL_BATCH
        dataset_fn = lambda epoch: bt.dataset_for_epoch(epoch, batch_size=batch)  # noqa: E731
    backup = BackupAndRestore(backup_dir, save_freq=2)
    with pytest.raises(ValueError, match=match) as error:
        model.fit(backup.wrap(dataset_fn), epochs=2, callbacks=[backup], verbose=0)
    assert f"backup_dir {str(backup_dir)!r}" in str(error.value)
    assert "Nothing in it was changed" in str(error.value)
    assert _snapshot(backup_dir) == before


def test_wrap_refuses_inputs_it_cannot_position(tmp_path):
    backup = BackupAndRestore(tmp_path / "backup")
    unknown = bt.dataset_for_epoch(0).filter(lambda x, y: True)
    with pytest.raises(ValueError, match=r"number of batches of dataset\(0\) is unknown"):
        backup.wrap(unknown)
    with pytest.raises(ValueError, match=r"is infinite"):
        backup.wrap(bt.dataset_for_epoch(0).repeat())
    with pytest.raises(TypeError, match=r"Received: dataset\(0\) -> ndarray"):
        backup.wrap(lambda epoch: np.zeros(3))
    with pytest.raises(ValueError, match=r"`steps_per_epoch` must be a positive integer"):
        backup.wrap(bt.dataset_for_epoch, steps_per_epoch=0)
    assert backup.wrap(unknown, steps_per_epoch=3).num_batches == 3


def test_an_epoch_with_fewer_batches_is_refused(tmp_path):
    model = _model(_strategy(1))
    backup = BackupAndRestore(tmp_path / "backup")
    shrinking = lambda epoch: bt.dataset_for_epoch(epoch).take(6 - epoch)  # noqa: E731
    with pytest.raises(ValueError, match=r"same number of batches \(6\).*"
                                         r"dataset_fn\(1\) has 5"):
        model.fit(backup.wrap(shrinking), epochs=2, callbacks=[backup], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == bt.STEPS_PER_EPOCH


def test_fit_steps_per_epoch_is_refused_with_the_wrapped_input(tmp_path):
    model = _model(_strategy(1))
    backup = BackupAndRestore(tmp_path / "backup")
    with pytest.raises(ValueError, match=r"do not pass `steps_per_epoch` to fit"):
        model.fit(backup.wrap(bt.dataset_for_epoch), steps_per_epoch=3, epochs=1,
                  callbacks=[backup], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


# --- two workers ----------------------------------------------------------------

JOB = Path(__file__).with_name("backup_multiworker_job.py")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_sigterm_then_resume(tmp_path):
    from multiworker import python_command, run_launch, start_launch, wait_for_files

    import backup_multiworker_job as job

    scratch = tmp_path / "tmp"  # the workers' TMPDIR: non-chief saves go here
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    backup_dir = tmp_path / "backup"

    # Launch 1: SIGTERM to the launcher (forwarded to both workers) mid-epoch 1.
    with start_launch(python_command(JOB, "train", str(tmp_path)), nproc=2, env=env,
                      cwd=tmp_path, launch_args=["--grace_period", "60"]) as launch:
        step_file = tmp_path / "step-0"
        while True:
            wait_for_files([step_file], timeout=150, job=launch)
            if int(step_file.read_text() or 0) >= job.PAUSE_AFTER:
                break
        launch.send_signal(signal.SIGTERM)
        result = launch.wait(timeout=90)
    assert result.returncode == 128 + signal.SIGTERM, result.describe()
    assert not any("sending SIGKILL" in line for line in result.launcher_messages()), (
        result.describe())
    exits = [json.loads((tmp_path / f"exit-{rank}.json").read_text()) for rank in range(2)]
    assert [e["code"] for e in exits] == [42, 42], result.describe()
    stopped_at = exits[0]["step"]
    assert exits[1]["step"] == stopped_at
    assert job.PAUSE_AFTER < stopped_at < bt.TOTAL_STEPS
    for rank in range(2):
        assert any("saved after SIGTERM; exiting with code 42" in line
                   for line in result.worker_stderr(rank)), result.describe()
    # The checkpoint is the step the workers stopped at: no step lost. Only the
    # chief wrote: one checkpoint in backup_dir, no other worker's files
    # beside it, and the non-chief's scratch directory is gone.
    assert _progress(backup_dir)["step"] == stopped_at
    assert sorted(p.name for p in backup_dir.iterdir()) == [
        "checkpoint", f"ckpt-{stopped_at}.data-00000-of-00001", f"ckpt-{stopped_at}.index"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["backup", "tmp"]
    assert list(scratch.iterdir()) == []

    # Launch 2: resume; each worker also trains an uninterrupted reference.
    result = run_launch(python_command(JOB, "resume", str(tmp_path)), nproc=2, env=env,
                        cwd=tmp_path, timeout=150)
    assert result.returncode == 0, result.describe()
    seen = [tuple(pair) for e in exits for pair in e["seen"]]
    for rank in range(2):
        with np.load(tmp_path / f"rank-{rank}.npz") as record:
            record = dict(record)
        assert int(record["steps"]) == bt.TOTAL_STEPS
        if rank == 0:  # the chief deletes it; the other worker may look before that
            assert not bool(record["backup_exists"])
        count = len([k for k in record if k.startswith("weight")])
        _assert_weights_equal([record[f"weight{i}"] for i in range(count)],
                              [record[f"reference{i}"] for i in range(count)])
        seen += [tuple(pair) for pair in record["seen"].tolist()]
    # Each worker trains on its share of every global batch; together, every
    # example exactly once per epoch across the interruption.
    _assert_each_example_once_per_epoch(seen)
    assert not backup_dir.exists()
    assert list(scratch.iterdir()) == []
