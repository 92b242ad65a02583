"""tfdp.app.experiment.train_and_evaluate, in-process, on the offline digits data."""

import dataclasses
import json
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.app import experiment
from tfdp.app import phase_clock
from tfdp.app import train as train_cli
from tfdp.app.run_config import ConfigError, RunConfig


def _small_model(name, *, input_shape, num_classes):
    assert name == "tiny"
    return keras.Sequential(
        [keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)]
    )


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("digits_data"))


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_run_writes_a_summary_the_chief_owns(tmp_path, digits_dir, loop):
    config = RunConfig(
        model="tiny", dataset="digits", data_dir=digits_dir, epochs=2, steps_per_epoch=5,
        cpu_replicas=2, global_batch=32, accum_steps=2, loop=loop, steps_per_loop=2,
        model_dir=str(tmp_path / "run"), optimizer="momentum", base_lr=0.05, warmup_steps=2,
    )
    summary = experiment.train_and_evaluate(
        config, build_dataset=train_cli._build_dataset(config), build_model=_small_model
    )
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == 10
    assert on_disk["batch"] == {"per_replica": 8, "replicas": 2, "accum_steps": 2, "global": 32}
    assert on_disk["strategy"]["num_replicas_in_sync"] == 2
    assert set(on_disk["train"]) >= {"loss", "accuracy"}
    assert set(on_disk["eval"]) >= {"loss", "accuracy"}
    assert 0.0 <= on_disk["eval"]["accuracy"] <= 1.0
    assert on_disk["examples_per_second"] > 0 and on_disk["wall_time_seconds"] > 0
    assert on_disk["config"]["loop"] == loop
    # Called without tfdp-train's clock: the phases start at the call (no
    # imports or checks); 5 steps per epoch run in 5 executions of 1 step
    # (fit: 1 divides 5) or calls of 2, 2 and 1 (custom).
    phases = on_disk["phases"]
    assert list(phases["seconds"]) == [name for name in phase_clock.PHASES
                                       if name not in ("imports", "checks")]
    assert sum(phases["seconds"].values()) <= phases["wall_seconds"]
    assert phases["counts"]["step_calls"] == {"fit": 10, "custom": 6}[loop]
    assert [row["epoch"] for row in phases["epochs"]] == [0, 1]
    assert None not in [row["first_call_seconds"] for row in phases["epochs"]]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_one_batch_config_flows_from_the_flags_to_the_data_and_the_training(
        monkeypatch, digits_dir, loop):
    # The BatchConfig the run logs is the very object make_dataset and the
    # training path receive: nothing takes it apart and builds it again.
    from tfdp import pipelines

    seen = {"datasets": [], "training": []}
    make_dataset = pipelines.make_dataset

    def recording_make_dataset(*args, batch, **kwargs):
        seen["datasets"].append(batch)
        return make_dataset(*args, batch=batch, **kwargs)

    class RecordingTrainer(experiment.Trainer):
        def __init__(self, *args, batch, **kwargs):
            seen["training"].append(batch)
            super().__init__(*args, batch=batch, **kwargs)

    compile_ = experiment.fit_compile.compile

    def recording_compile(model, *, accum_steps, **kwargs):
        seen["training"].append(accum_steps)
        return compile_(model, accum_steps=accum_steps, **kwargs)

    monkeypatch.setattr(pipelines, "make_dataset", recording_make_dataset)
    monkeypatch.setattr(experiment, "Trainer", RecordingTrainer)
    monkeypatch.setattr(experiment.fit_compile, "compile", recording_compile)
    config = RunConfig(model="tiny", dataset="digits", data_dir=digits_dir, epochs=1,
                       steps_per_epoch=2, cpu_replicas=2, global_batch=32, accum_steps=2,
                       loop=loop, steps_per_loop=1)
    summary = experiment.train_and_evaluate(
        config, build_dataset=train_cli._build_dataset(config), build_model=_small_model)
    batch = seen["datasets"][0]
    assert len(seen["datasets"]) >= 2  # training and evaluation
    assert all(b is batch for b in seen["datasets"])
    assert (batch.per_replica, batch.num_replicas, batch.accum_steps) == (8, 2, 2)
    assert summary["batch"] == {"per_replica": 8, "replicas": 2, "accum_steps": 2, "global": 32}
    assert seen["training"] == ([batch] if loop == "custom" else [batch.accum_steps])


def test_steps_per_epoch_beyond_the_data_is_refused(digits_dir):
    config = RunConfig(model="tiny", dataset="digits", data_dir=digits_dir, global_batch=64,
                       steps_per_epoch=1000, eval=False)
    with pytest.raises(ConfigError, match="--steps_per_epoch=1000 exceeds the 22 global batches"):
        experiment.train_and_evaluate(config, build_dataset=train_cli._build_dataset(config),
                                      build_model=_small_model)


class _Interrupted(Exception):
    """Stands for a crash between two epochs."""


def _run(config, *, crash_at_epoch=None):
    """Runs `config`; returns (summary, trained model). May raise `_Interrupted`
    (`--loop=fit` only: when epoch `crash_at_epoch` begins)."""
    built = {}

    def model(name, **kwargs):
        built["model"] = _small_model(name, **kwargs)
        return built["model"]

    epoch_begin = experiment._EpochTimer.on_epoch_begin  # pylint: disable=protected-access

    def crash_or_begin(self, epoch, logs=None):
        if epoch == crash_at_epoch:
            raise _Interrupted()
        return epoch_begin(self, epoch, logs)

    with mock.patch.object(experiment._EpochTimer, "on_epoch_begin", crash_or_begin):
        summary = experiment.train_and_evaluate(
            config, build_dataset=train_cli._build_dataset(config), build_model=model)
    return summary, built["model"]


@pytest.mark.slow
def test_fit_loop_resumes_from_its_backup_like_an_uninterrupted_run(tmp_path, digits_dir):
    options = dict(model="tiny", dataset="digits", data_dir=digits_dir, global_batch=64,
                   epochs=3, steps_per_epoch=4, steps_per_loop=2, checkpoint_every=2,
                   eval=False, loop="fit")
    _, reference = _run(RunConfig(**options, model_dir=str(tmp_path / "straight")))

    run_dir = tmp_path / "resumed"
    config = RunConfig(**options, model_dir=str(run_dir))
    with pytest.raises(_Interrupted):
        _run(config, crash_at_epoch=2)  # after epoch 1's backup, before epoch 2
    assert (run_dir / "backup").is_dir() and not (run_dir / "checkpoint").exists()
    summary, resumed = _run(config)
    assert summary["steps"] == 12
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert not (run_dir / "backup").exists()  # removed once training completed
    assert tf.train.latest_checkpoint(str(run_dir)).endswith("ckpt-12")


@pytest.mark.slow
def test_fit_loop_reruns_a_finished_run_without_training_it_again(tmp_path, digits_dir):
    config = RunConfig(model="tiny", dataset="digits", data_dir=digits_dir, global_batch=64,
                       epochs=1, steps_per_epoch=2, model_dir=str(tmp_path))
    first, _ = _run(config)
    again, _ = _run(config)
    assert again["steps"] == first["steps"] == 2
    assert again["eval"] == pytest.approx(first["eval"])
    longer = dataclasses.replace(config, epochs=2)
    with pytest.raises(ConfigError, match="holds a finished --loop=fit run of 2 steps"):
        _run(longer)


@pytest.mark.slow
def test_fit_loop_reruns_a_finished_run_that_skipped_nonfinite_steps(tmp_path, digits_dir):
    # optimizer.iterations counts applied updates only: a finished run of 2
    # training steps, one skipped for a non-finite gradient, holds iterations
    # 1 and skipped_steps 1. Its rerun must see 2 steps, not a shorter run.
    config = RunConfig(model="tiny", dataset="digits", data_dir=digits_dir, global_batch=64,
                       epochs=1, steps_per_epoch=2, model_dir=str(tmp_path), eval=False)
    _, model = _run(config)
    guard = model.optimizer
    assert int(guard.skipped_steps.numpy()) == 0 and int(guard.iterations.numpy()) == 2
    guard.iterations.assign(1)
    guard.skipped_steps.assign(1)
    saved = tf.train.latest_checkpoint(str(tmp_path))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=guard)
    checkpoint.save_counter.assign(1)  # as the run's own save wrote it
    checkpoint.write(saved)

    again, rerun = _run(config)
    assert again["steps"] == 2
    assert int(rerun.optimizer.iterations.numpy()) == 1  # restored, not trained again
    longer = dataclasses.replace(config, epochs=2)
    with pytest.raises(ConfigError, match="holds a finished --loop=fit run of 2 steps"):
        _run(longer)
