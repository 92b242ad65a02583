"""`tfdp-train --dataset=python:module:function`: your own tf.data code.

The test writes the module into a temporary directory and runs `tfdp-train`
from there, as a user would (the working directory is importable).
"""

import json
import os
import shutil
import subprocess
import textwrap

import pytest

from multiworker import REPO_ROOT
from multiworker import run_launch

MODULE = textwrap.dedent('''
    """Digits three ways: a pipelines source with splits, a dataset, a dataset_fn."""
    import os

    import tensorflow as tf
    from tfdp.pipelines import digits


    def with_splits():
        from tfdp import pipelines
        return pipelines.get_source("digits", data_dir=os.environ["DIGITS_DATA_DIR"])


    def one_split():
        images, labels = digits.load_arrays()
        images = tf.constant(images[..., None] / 16.0, tf.float32)
        return tf.data.Dataset.from_tensor_slices((images, labels.astype("int64")))


    def per_pipeline(input_context):
        # Shards itself by the input context, as a dataset_fn does.
        return one_split().shard(input_context.num_input_pipelines,
                                 input_context.input_pipeline_id)
''')


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user_code")
    (directory / "my_digits.py").write_text(MODULE)
    return directory


def _env(workdir):
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
            "DIGITS_DATA_DIR": str(workdir / "tfds")}


def _tfdp_train(workdir, *flags, timeout=300):
    return subprocess.run([shutil.which("tfdp-train"), "--model=cnn", *flags], cwd=workdir,
                          env=_env(workdir), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_function_returning_a_source_with_splits_trains_and_evaluates(workdir, tmp_path):
    done = _tfdp_train(workdir, "--dataset=python:my_digits:with_splits", "--epochs=2",
                       f"--model_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval"]["accuracy"] > 0.5 and summary["steps"] == 2 * (1437 // 64)


@pytest.mark.slow
def test_a_dataset_fn_shards_itself_on_two_workers(workdir, tmp_path):
    command = [shutil.which("tfdp-train"), "--model=cnn", "--dataset=python:my_digits:per_pipeline",
               "--noeval", "--epochs=1", "--num_classes=10", f"--model_dir={tmp_path}"]
    result = run_launch(command, nproc=2, timeout=300, cwd=workdir, check=True,
                        env={"DIGITS_DATA_DIR": str(workdir / "tfds")})
    log = "\n".join(result.worker_stderr(0) + result.worker_stdout(0))
    assert "callable/train: 1797 examples" in log
    assert "shard context (the source shards itself by its input context)" in log
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1797 // 64


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--dataset=python:my_digits:nothing"], "my_digits has no function 'nothing'"),
    (["--dataset=python:not_a_module:f"], "cannot import 'not_a_module'"),
    (["--dataset=python:my_digits"], "write python:package.module:function"),
    (["--dataset=python:my_digits:one_split", "--num_classes=10"],
     "gives one split (a dataset, or a function of the input context), so --eval"),
    (["--dataset=python:my_digits:one_split", "--noeval"], "pass --num_classes"),
])
def test_bad_python_datasets_exit_2_with_one_line(workdir, flags, message):
    done = _tfdp_train(workdir, *flags, "--epochs=1", timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("tfdp-train:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and message in lines[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
