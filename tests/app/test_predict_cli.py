"""`tfdp-predict` end to end: a `tfdp-train` run's model scores all 1,797 digits
on two workers through `launch`, survives a killed worker under
`--max_restarts`, and refuses bad input with exit 2 and one line.

One short training run (module fixture) provides the model; reference
predictions come from the same checkpoint restored in this process and
`model.predict` on one device.
"""

import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from multiworker import REPO_ROOT
from multiworker import marked_processes
from multiworker import run_launch
from multiworker import start_launch

#: All of digits: 1,797 examples, not a multiple of any batch used here.
SPLIT = "train+test"
RUN_TIMEOUT = 300.0


def _env():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run(*flags, timeout=120.0):
    return subprocess.run([shutil.which("tfdp-predict"), *flags], env=_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model_dir, data_dir) of a finished one-epoch tfdp-train run on digits."""
    root = tmp_path_factory.mktemp("predict_cli")
    model_dir, data_dir = root / "run", root / "tfds"
    subprocess.run(
        [shutil.which("tfdp-train"), "--dataset=digits", "--model=cnn", "--epochs=1",
         f"--model_dir={model_dir}", f"--data_dir={data_dir}"],
        env=_env(), check=True, capture_output=True, timeout=RUN_TIMEOUT,
    )
    return model_dir, data_dir


@pytest.fixture(scope="module")
def expected(trained):
    """Single-process `model.predict` of the trained model on all digits, in order."""
    from tfdp import pipelines
    from tfdp.app import run_model

    model_dir, data_dir = trained
    config = json.loads((model_dir / "summary.json").read_text())["config"]
    model, _ = run_model.restore_model(str(model_dir), config, tf.distribute.get_strategy(),
                                         data_dir=str(data_dir))
    source = pipelines.get_source("digits", split=SPLIT, data_dir=str(data_dir))
    images = source.read(SPLIT).map(pipelines.for_images(training=False)).map(lambda x, y: x)
    images = np.stack(list(images.as_numpy_iterator()))
    assert len(images) == 1797
    return model.predict(images, batch_size=128, verbose=0)


def _predict_command(trained, output_dir, *flags):
    model_dir, data_dir = trained
    return [shutil.which("tfdp-predict"), f"--model_dir={model_dir}", f"--data_dir={data_dir}",
            f"--split={SPLIT}", f"--output_dir={output_dir}", *flags]


def _check_predictions(output_dir, expected):
    result = tfdp.read_predictions(str(output_dir), as_numpy=True)
    np.testing.assert_array_equal(result["id"], np.arange(1797))
    np.testing.assert_allclose(result["predictions"], expected, atol=1e-5)
    return result


@pytest.mark.slow
def test_two_workers_and_two_replicas_score_every_digit_once_as_one_device_does(
    tmp_path, trained, expected
):
    out = tmp_path / "two_workers"
    result = run_launch(_predict_command(trained, out, "--batch_size=64"), nproc=2,
                        timeout=RUN_TIMEOUT, check=True)
    _check_predictions(out, expected)
    # Each worker wrote its own shards; the chief reported the totals.
    writers = {name.split("-")[1] for name in os.listdir(out) if name.startswith("part-")}
    assert writers == {"00000", "00001"}
    assert any("all 1797 predictions written" in line for line in result.worker_stdout(0))
    rows = list(tfdp.read_predictions(str(out)).as_numpy_iterator())
    assert [row["id"] for row in rows] == list(range(1797))

    # MirroredStrategy over 2 logical CPU replicas in one process: the same.
    one_process = tmp_path / "two_replicas"
    done = _run(*_predict_command(trained, one_process, "--cpu_replicas=2")[1:], timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    _check_predictions(one_process, expected)


def _worker_pid(token: str, rank: int) -> int | None:
    for pid in marked_processes(token):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"TFDP_RANK={rank}".encode() in environ:
            return pid
    return None


def _shard_files(output_dir):
    """{file: (inode, mtime_ns)} of the shards whose entry is written."""
    files = {}
    entries = output_dir / "entries"
    for name in os.listdir(entries) if entries.exists() else []:
        if not name.endswith(".json"):
            # An entry's temporary file (`00009.json.tmp-PID-...`, renamed when
            # whole): a worker killed before the rename has not completed it.
            continue
        try:
            entry = json.loads((entries / name).read_text())
            stat = os.stat(output_dir / entry["file"])
        except (OSError, ValueError):
            continue  # being written right now
        files[entry["file"]] = (stat.st_ino, stat.st_mtime_ns)
    return files


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_only_unfinished_shards_are_scored(
    tmp_path, trained, expected
):
    out = tmp_path / "preds"
    # Small shards so that most are still to do when the first few are written.
    command = _predict_command(trained, out, "--batch_size=16", "--shard_size=16")
    with start_launch(command, nproc=2, launch_args=["--max_restarts", "1"]) as job:
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(_shard_files(out)) < 4:
            assert job.proc.poll() is None, "the job ended before any worker was killed"
            assert time.monotonic() < deadline, "no shard was written in time"
            time.sleep(0.02)
        victim = _worker_pid(job.token, 1)
        before = _shard_files(out)
        os.kill(victim, signal.SIGKILL)
        result = job.wait(RUN_TIMEOUT)
    assert result.returncode == 0, result.describe()
    assert any("restart" in line for line in result.launcher_messages()), result.describe()
    assert len(before) < 113, "the kill came after every shard was written"
    after = _shard_files(out)
    assert {name: after[name] for name in before} == before, "a complete shard was redone"
    _check_predictions(out, expected)


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_and_changes_nothing(tmp_path, trained):
    model_dir, data_dir = trained
    cases = {
        "no_run": ([f"--model_dir={tmp_path}", f"--output_dir={tmp_path / 'a'}"],
                   "holds no finished tfdp-train run"),
        "shape": (_predict_command(trained, tmp_path / "b", "--dataset=synthetic_images",
                                   "--split=train")[1:],
                  "shape (32, 32, 3), but the model expects (8, 8, 1)"),
        "unwritable": (_predict_command(trained, model_dir / "summary.json" / "out")[1:],
                       "not writable"),
    }
    # An output_dir that holds another model's predictions.
    other = tmp_path / "other"
    import keras

    tiny = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    tfdp.predict(tiny, tf.data.Dataset.from_tensor_slices(np.zeros((1797, 8, 8, 1), "float32")),
                 output_dir=str(other), verbose=0)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in other.iterdir())
    cases["other_model"] = (_predict_command(trained, other)[1:],
                            "holds predictions of another run: model")
    for name, (flags, message) in cases.items():
        done = _run(*flags)
        lines = [line for line in done.stderr.splitlines() if line.startswith("tfdp-predict:")]
        assert done.returncode == 2, (name, done.stderr[-2000:])
        assert len(lines) == 1 and message in lines[0], (name, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, name
    assert sorted((p.name, p.stat().st_mtime_ns) for p in other.iterdir()) == before
    assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "run.json").exists()

