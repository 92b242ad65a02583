"""tfdp.Trainer under faults: SIGTERM (save, exit 42, resume exactly) and NaN/Inf steps.

Reference checks: a run interrupted by SIGTERM and rerun ends with the
weights of a run that never stopped (1e-6) and, by the model's per-example
counter (`trainer_faults_job.build_trainer`), trained on every example exactly
once per epoch; a run that meets a NaN batch ends with the weights of a run
that never saw that batch, every replica alike.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfdp
import trainer_faults_job as job
from tfdp.callbacks import PREEMPTION_EXIT_CODE
from tfdp.training.nonfinite import NonFiniteError


@pytest.fixture(autouse=True)
def _keep_sigterm_handler():
    """A Trainer stopped by an exception must not leave its handler behind."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    assert signal.getsignal(signal.SIGTERM) is previous
    signal.signal(signal.SIGTERM, previous)


def _strategy(replicas):
    return tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1 else tfdp.make_strategy("default")


def _sigterm_after(trainer, calls):
    """Sends SIGTERM to this process at the end of the `calls`-th training call."""
    done = []

    def sigterm_at_the_end():
        done.append(1)
        if len(done) == calls:
            # Never kill the test run: the Trainer's handler must be in place.
            assert signal.getsignal(signal.SIGTERM) not in (None, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.train_loop_end = sigterm_at_the_end


def _checkpoint_steps(model_dir: Path) -> list[int]:
    return sorted(int(p.name[len("ckpt-"):-len(".index")]) for p in model_dir.glob("ckpt-*.index"))


def _assert_weights_equal(got, want, atol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=0)


# --- SIGTERM ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas, accum_steps, steps_per_loop, checkpoint_every, calls, stopped_at",
    [
        (1, 1, 1, None, 7, 7),  # mid-epoch 1, no periodic checkpoint
        # 2 replicas, 3 steps a call: SIGTERM in the call that ends at step 9
        # (a checkpoint_every multiple: saved once, not twice).
        (2, 2, 3, 9, 3, 9),
    ],
)
def test_sigterm_saves_the_current_step_exits_42_and_a_rerun_resumes_exactly(
    tmp_path, replicas, accum_steps, steps_per_loop, checkpoint_every, calls, stopped_at
):
    strategy = _strategy(replicas)
    kwargs = dict(accum_steps=accum_steps, steps_per_loop=steps_per_loop,
                  checkpoint_every=checkpoint_every)
    straight = job.build_trainer(strategy, **kwargs)
    straight.train(job.dataset_for_epoch, steps=job.TOTAL_STEPS)

    model_dir = tmp_path / "model"
    before = signal.getsignal(signal.SIGTERM)
    first = job.build_trainer(strategy, str(model_dir), **kwargs)
    _sigterm_after(first, calls)
    with pytest.raises(SystemExit) as exit_info:
        first.train(job.dataset_for_epoch, steps=job.TOTAL_STEPS)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE == 42
    assert signal.getsignal(signal.SIGTERM) is before  # handler put back before exiting
    assert first.global_step == stopped_at
    # The checkpoint is the step it stopped at: no step lost.
    assert tf.train.latest_checkpoint(str(model_dir)).endswith(f"ckpt-{stopped_at}")
    assert _checkpoint_steps(model_dir)[-1] == stopped_at

    # The same call again, in a fresh Trainer (other initial weights).
    second = job.build_trainer(strategy, str(model_dir), seed=5, **kwargs)
    result = second.train(job.dataset_for_epoch, steps=job.TOTAL_STEPS)
    assert result["steps"] == second.global_step == job.TOTAL_STEPS
    assert int(second.optimizer.iterations.numpy()) == job.TOTAL_STEPS
    _assert_weights_equal(job.trainable_weights(second), job.trainable_weights(straight))
    for want, got in zip(straight.optimizer.variables, second.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    # The counts are in the checkpoint: across the interruption, each example
    # was trained on exactly once per epoch.
    np.testing.assert_array_equal(job.counts(second), job.expected_counts(job.TOTAL_STEPS))
    np.testing.assert_array_equal(job.counts(straight), job.expected_counts(job.TOTAL_STEPS))
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_in_the_last_call_saves_the_final_step(tmp_path):
    strategy = _strategy(1)
    model_dir = tmp_path / "model"
    trainer = job.build_trainer(strategy, str(model_dir), steps_per_loop=job.STEPS_PER_EPOCH)
    _sigterm_after(trainer, job.EPOCHS)
    with pytest.raises(SystemExit):
        trainer.train(job.dataset_for_epoch, steps=job.TOTAL_STEPS)
    assert _checkpoint_steps(model_dir) == [job.TOTAL_STEPS]  # the final save, once
    rerun = job.build_trainer(strategy, str(model_dir), steps_per_loop=job.STEPS_PER_EPOCH)
    assert rerun.train(job.dataset_for_epoch, steps=job.TOTAL_STEPS)["steps"] == job.TOTAL_STEPS
    assert _checkpoint_steps(model_dir) == [job.TOTAL_STEPS]  # nothing trained, nothing saved


@pytest.mark.parametrize("model_dir, save_on_sigterm", [(False, True), (True, False)])
def test_sigterm_is_left_alone_without_model_dir_or_when_disabled(tmp_path, model_dir,
                                                                   save_on_sigterm):
    before = signal.getsignal(signal.SIGTERM)
    trainer = job.build_trainer(_strategy(1), str(tmp_path / "m") if model_dir else None,
                                save_on_sigterm=save_on_sigterm)
    seen = []
    trainer.train_loop_begin = lambda: seen.append(signal.getsignal(signal.SIGTERM))
    trainer.train(job.dataset_for_epoch, steps=3)
    assert seen == [before] * 3


# --- two workers ------------------------------------------------------------------

JOB = Path(__file__).with_name("trainer_faults_job.py")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_sigterm_save_exit_42_then_resume_and_skip_a_nan_batch(tmp_path):
    from multiworker import python_command, run_launch, start_launch, wait_for_files

    scratch = tmp_path / "tmp"  # the workers' TMPDIR: non-chief saves go here
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    model_dir = tmp_path / "model"

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
    assert exits[1]["step"] == stopped_at  # an agreed step
    assert job.PAUSE_AFTER <= stopped_at < job.TOTAL_STEPS
    for rank in range(2):
        assert any("tfdp trainer: saved after SIGTERM; exiting with code 42" in line
                   for line in result.worker_stderr(rank)), result.describe()
    # Only the chief wrote: one checkpoint, of the step both stopped at; the
    # non-chief's scratch directory is gone.
    assert _checkpoint_steps(model_dir) == [stopped_at]
    assert sorted(p.name for p in model_dir.iterdir() if p.is_file()) == [
        "checkpoint", f"ckpt-{stopped_at}.data-00000-of-00001", f"ckpt-{stopped_at}.index"]
    assert list(scratch.iterdir()) == []

    # Launch 2: resume (and an uninterrupted reference), then the NaN case.
    result = run_launch(python_command(JOB, "resume", str(tmp_path)), nproc=2, env=env,
                        cwd=tmp_path, timeout=150)
    assert result.returncode == 0, result.describe()
    for rank in range(2):
        with np.load(tmp_path / f"rank-{rank}.npz") as record:
            record = dict(record)
        assert int(record["steps"]) == job.TOTAL_STEPS
        count = len([k for k in record if k.startswith("weight")])
        _assert_weights_equal([record[f"weight{i}"] for i in range(count)],
                              [record[f"reference{i}"] for i in range(count)])
        # Counted over both workers' replicas, restored across the restart.
        np.testing.assert_array_equal(record["counts"], job.expected_counts(job.TOTAL_STEPS))
        # Worker 1 held the NaN; both skipped that step and match a run
        # that never saw the batch.
        assert int(record["nan_skipped"]) == 1
        assert int(record["nan_iterations"]) == job.STEPS_PER_EPOCH - 1
        _assert_weights_equal([record[f"nan_weight{i}"] for i in range(count)],
                              [record[f"nan_reference{i}"] for i in range(count)])
    assert list(scratch.iterdir()) == []


# --- non-finite steps ----------------------------------------------------------------


def _replica_values(strategy, variable):
    return [np.asarray(v.numpy()) for v in strategy.experimental_local_results(variable.value)]


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps, steps_per_loop, nan_value",
                         [(1, 1, np.nan), (2, 4, np.inf)])
def test_a_nan_on_one_replica_is_skipped_by_every_replica(tmp_path, accum_steps, steps_per_loop,
                                                          nan_value):
    strategy = _strategy(2)
    kwargs = dict(accum_steps=accum_steps, steps_per_loop=steps_per_loop)
    never_saw = job.build_trainer(strategy, **kwargs)
    never_saw.train(lambda e: job.dataset_for_epoch(e, drop_batch=job.NAN_BATCH),
                    steps=job.STEPS_PER_EPOCH - 1)

    trainer = job.build_trainer(strategy, str(tmp_path / "model"), checkpoint_every=2, **kwargs)
    result = trainer.train(
        lambda e: job.dataset_for_epoch(e, nan_batch=job.NAN_BATCH, nan_value=nan_value),
        steps=job.STEPS_PER_EPOCH)
    # Step 3 (batch 2) was skipped: counted, not an optimizer step.
    assert result["skipped_steps"] == trainer.skipped_steps == 1
    assert result["steps"] == trainer.global_step == job.STEPS_PER_EPOCH
    assert int(trainer.optimizer.iterations.numpy()) == job.STEPS_PER_EPOCH - 1
    assert int(trainer.optimizer.consecutive_skipped_steps.numpy()) == 0
    for variable, want in zip(trainer.model.trainable_weights, job.trainable_weights(never_saw)):
        replicas = _replica_values(strategy, variable)
        np.testing.assert_array_equal(replicas[0], replicas[1])  # identical replicas
        np.testing.assert_allclose(replicas[0], want, atol=1e-6, rtol=0)
    # Checkpoint numbers count global batches; the skip count is checkpointed.
    assert _checkpoint_steps(tmp_path / "model") == [2, 4, 6]
    latest = tf.train.latest_checkpoint(str(tmp_path / "model"))
    names = [n for n, _ in tf.train.list_variables(latest) if "skipped_steps" in n]
    assert names and all(int(tf.train.load_variable(latest, n)) in (0, 1) for n in names)


def _assert_checkpoints_finite(model_dir: Path):
    for step in _checkpoint_steps(model_dir):
        path = str(model_dir / f"ckpt-{step}")
        for name, _ in tf.train.list_variables(path):
            value = tf.train.load_variable(path, name)
            if np.asarray(value).dtype.kind == "f":
                assert np.isfinite(value).all(), (path, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nonfinite, limit, steps_per_loop, checkpoint_every",
    [
        # One call runs the whole epoch: steps 3-5 are NaN and step 6 is
        # finite, but after the limit nothing more is applied.
        ("skip", 3, job.STEPS_PER_EPOCH, None),
        ("raise", 1, 1, 1),
    ],
)
def test_consecutive_non_finite_steps_stop_training_with_the_fix(
    tmp_path, nonfinite, limit, steps_per_loop, checkpoint_every
):
    strategy = _strategy(2)
    bad = (2, 3, 4)  # global batches: steps 3-5

    def poisoned(epoch):
        x, y = job.arrays()
        order = job.epoch_order(epoch)
        x = x[order].copy()
        for b in bad:
            x[b * job.GLOBAL_BATCH + job.NAN_EXAMPLE, 0] = np.nan
        ids = (epoch * job.NUM_EXAMPLES + order).astype("int32")
        return tf.data.Dataset.from_tensor_slices(
            ({"features": x, "id": ids}, y[order])).batch(job.GLOBAL_BATCH, drop_remainder=True)

    reference = job.build_trainer(strategy)
    reference.train(poisoned, steps=2)  # the two good steps
    model_dir = tmp_path / "model"
    trainer = job.build_trainer(
        strategy, str(model_dir), checkpoint_every=checkpoint_every,
        steps_per_loop=steps_per_loop, nonfinite=nonfinite,
        max_consecutive_nonfinite=limit if nonfinite == "skip" else 5)
    with pytest.raises(NonFiniteError) as error:
        trainer.train(poisoned, steps=job.TOTAL_STEPS)
    message = str(error.value)
    last = 2 + limit
    assert f"{limit} training steps in a row (steps 3-{last}," in message
    assert f"max_consecutive_nonfinite={limit}" in message
    assert "The weights are those after step 2" in message
    assert "Lower the learning rate" in message and "loss scaling" in message
    assert trainer.skipped_steps == limit
    assert int(trainer.optimizer.iterations.numpy()) == 2
    _assert_weights_equal(job.trainable_weights(trainer), job.trainable_weights(reference))
    # Skips change no weight, so checkpoints of skipped steps are fine; none
    # after the limit, and nothing non-finite.
    assert all(step <= last for step in _checkpoint_steps(model_dir))
    _assert_checkpoints_finite(model_dir)


def test_without_handling_non_finite_weights_are_never_saved(tmp_path):
    model_dir = tmp_path / "model"
    trainer = job.build_trainer(_strategy(1), str(model_dir), checkpoint_every=1, nonfinite=None)
    assert trainer.skipped_steps == 0
    with pytest.raises(NonFiniteError, match=r"not saving the checkpoint of step 3: .*NaN or "
                                             r"Inf .*the newest checkpoint is still .*ckpt-2"):
        trainer.train(lambda e: job.dataset_for_epoch(e, nan_batch=job.NAN_BATCH),
                      steps=job.STEPS_PER_EPOCH)
    assert _checkpoint_steps(model_dir) == [1, 2]
    _assert_checkpoints_finite(model_dir)


@pytest.mark.parametrize("kwargs, match", [
    (dict(nonfinite="ignore"), r"`nonfinite` must be 'skip'.*Received: nonfinite='ignore'"),
    (dict(max_consecutive_nonfinite=0), r"`max_consecutive_nonfinite` must be a positive"),
    (dict(max_consecutive_nonfinite=True), r"Received: max_consecutive_nonfinite=True"),
])
def test_invalid_nonfinite_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        job.build_trainer(_strategy(1), **kwargs)
