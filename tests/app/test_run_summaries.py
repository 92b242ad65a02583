"""Progress lines, TensorBoard scalars and curves.png for `--loop=fit`."""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.app import run_summaries


def _fit(model, progress, epochs=2, initial_epoch=0):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    model.fit(x, y, batch_size=8, epochs=epochs, initial_epoch=initial_epoch,
              callbacks=[progress], verbose=0)


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _progress(model, log_dir, lines, total=16):
    return run_summaries.FitProgress(
        batch=tfdp.BatchConfig.from_global(8, 1), total_steps=total,
        global_step=lambda: int(model.optimizer.iterations.numpy()), log_dir=str(log_dir),
        log_every=3, is_chief=True, print_fn=lines.append)


def test_fit_writes_the_custom_loops_scalars_and_a_line_every_log_every_steps(tmp_path):
    model, lines = _model(), []
    _fit(model, _progress(model, tmp_path / "train", lines))
    assert [line.split(":")[1].strip() for line in lines] == [
        "step 3/16", "step 6/16", "step 9/16", "step 12/16", "step 15/16", "step 16/16"]
    assert "loss" in lines[0] and "accuracy" in lines[0] and "examples/s, ETA" in lines[0]
    scalars = run_summaries.read_scalars(str(tmp_path / "train"))
    assert {"loss", "accuracy", "learning_rate", "examples_per_second", "batch/global",
            "batch/per_replica", "batch/replicas", "batch/accum_steps"} <= set(scalars)
    assert [step for step, _ in scalars["loss"]] == [3, 6, 9, 12, 15, 16]
    assert scalars["batch/global"] == [(0, 8.0)]
    assert scalars["learning_rate"][0][1] == pytest.approx(0.1)


@pytest.mark.slow
def test_a_resumed_run_appends_and_the_curves_are_drawn(tmp_path):
    model, lines = _model(), []
    _fit(model, _progress(model, tmp_path / "train", lines, total=24), epochs=2)
    _fit(model, _progress(model, tmp_path / "train", lines, total=24), epochs=3,
         initial_epoch=2)
    steps = [step for step, _ in run_summaries.read_scalars(str(tmp_path / "train"))["loss"]]
    assert steps == [3, 6, 9, 12, 15, 18, 21, 24]
    run_summaries.write_eval_scalars(str(tmp_path), 24, {"loss": 0.5, "accuracy": 0.75})
    assert run_summaries.read_scalars(str(tmp_path / "eval"))["accuracy"] == [(24, 0.75)]
    path = run_summaries.plot_curves(str(tmp_path), steps_per_epoch=8)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_other_workers_neither_print_nor_write(tmp_path):
    model, lines = _model(), []
    progress = _progress(model, tmp_path / "train", lines)
    progress.is_chief = False
    _fit(model, progress)
    assert not lines and not (tmp_path / "train").exists()


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_tfdp_train_writes_event_files_curves_and_says_where(tmp_path, loop):
    import json
    import os
    import shutil
    import subprocess

    from multiworker import REPO_ROOT

    model_dir = tmp_path / "run"
    done = subprocess.run(
        [shutil.which("tfdp-train"), "--dataset=digits", "--model=cnn", "--epochs=2",
         f"--loop={loop}", "--log_every=10", f"--model_dir={model_dir}",
         f"--data_dir={tmp_path / 'tfds'}"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["tensorboard"] == {"train": str(model_dir / "train"),
                                      "eval": str(model_dir / "eval")}
    assert summary["model"] == {"name": "cnn", "input_shape": [8, 8, 1], "num_classes": 10,
                                "arguments": {}}
    assert summary["eval_split"] == "test"
    train = run_summaries.read_scalars(summary["tensorboard"]["train"])
    assert {"loss", "accuracy", "learning_rate", "examples_per_second", "batch/global"} <= set(train)
    assert train["loss"][-1][0] == summary["steps"] == 44
    evaluation = run_summaries.read_scalars(summary["tensorboard"]["eval"])
    assert evaluation["accuracy"] == [(44, pytest.approx(summary["eval"]["accuracy"]))]
    assert open(summary["curves"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    if loop == "fit":  # stdout is a pipe here, as under tfdp-launch: step lines
        steps = [line.split(":")[1].strip() for line in done.stdout.splitlines()
                 if line.startswith("tfdp-train: step ")]
        # Executions of 10 steps, 10 + 10 + 2 per epoch: a line at the first one past
        # each multiple of 10, and at the end.
        assert steps == ["step 10/44", "step 20/44", "step 32/44", "step 42/44", "step 44/44"]
