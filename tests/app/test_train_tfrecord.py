"""`tfdp-train --dataset=tfrecord`: the user's own files, end to end on two workers.

The test writes all 1,797 digits as PNG-encoded `tf.train.Example` records (a
fixed train/test split by position); two workers train on them through
`tfdp-launch` as a user would. With more files than workers each worker reads
whole files (each example once per epoch over the workers); with fewer, the
workers shard by record (each reads every raw record and decodes only its
own), as the log says.
"""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.pipelines import digits as digits_lib
from multiworker import REPO_ROOT
from multiworker import run_launch

TARGET_ACCURACY = 0.95
RUN_TIMEOUT = 420.0


def _write(directory, images, labels, num_files):
    os.makedirs(directory, exist_ok=True)
    for index, part in enumerate(np.array_split(np.arange(len(labels)), num_files)):
        with tf.io.TFRecordWriter(os.path.join(directory, f"part-{index:03d}.tfrecord")) as w:
            for i in part:
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[tf.io.encode_png(images[i]).numpy()])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[labels[i]])),
                })).SerializeToString())


@pytest.fixture(scope="module")
def digits_files(tmp_path_factory):
    """Globs {"train": 6 files, "test": 2 files, "one": 1 train file} and the
    test labels in file order."""
    root = tmp_path_factory.mktemp("digits_records")
    images, labels = digits_lib.load_arrays()
    images = (images * (255 / 16)).round().astype(np.uint8)[..., None]  # float64 product
    labels = labels.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1437], order[1437:]
    _write(root / "train", images[train], labels[train], 6)
    _write(root / "test", images[test], labels[test], 2)
    _write(root / "one", images[train], labels[train], 1)
    files = {name: str(root / name / "*.tfrecord") for name in ("train", "test", "one")}
    return {**files, "test_labels": labels[test]}


def _train(tmp_path, *flags):
    model_dir = tmp_path / "run"
    command = [shutil.which("tfdp-train"), "--dataset=tfrecord", "--model=cnn",
               "--image_channels=1", f"--model_dir={model_dir}", *flags]
    result = run_launch(command, nproc=2, timeout=RUN_TIMEOUT, cwd=tmp_path, check=True)
    return result, json.loads((model_dir / "summary.json").read_text())


@pytest.mark.slow
def test_own_tfrecord_files_train_to_target_accuracy_sharded_by_file(tmp_path, digits_files):
    result, summary = _train(tmp_path, f"--train_files={digits_files['train']}",
                             f"--eval_files={digits_files['test']}")
    assert summary["eval"]["accuracy"] >= TARGET_ACCURACY, summary["eval"]
    assert summary["strategy"]["num_workers"] == 2
    log = "\n".join(result.worker_stderr(0) + result.worker_stdout(0))
    assert "tfrecord/train: 1437 examples" in log
    assert "shard file (6 files over 2 input pipelines)" in log
    # Counted once per split, cached in model_dir.
    assert len(list((tmp_path / "run").glob("tfrecord-counts-*.json"))) == 2

    # The trained model scores the test files with tfdp-predict: in file order,
    # as accurate as the run's own evaluation said.
    preds = tmp_path / "preds"
    done = subprocess.run(
        [shutil.which("tfdp-predict"), f"--model_dir={tmp_path / 'run'}", "--dataset=tfrecord",
         f"--files={digits_files['test']}", f"--output_dir={preds}", "--cpu_replicas=2"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = tfdp.read_predictions(str(preds), as_numpy=True)
    accuracy = np.mean(result["predictions"].argmax(axis=1) == digits_files["test_labels"])
    assert accuracy == pytest.approx(summary["eval"]["accuracy"], abs=1e-6)


@pytest.mark.slow
def test_fewer_files_than_workers_shard_by_record(tmp_path, digits_files):
    result, summary = _train(tmp_path, f"--train_files={digits_files['one']}", "--noeval",
                             "--epochs=1", "--train_examples=1437")
    log = "\n".join(result.worker_stderr(0) + result.worker_stdout(0))
    assert "tfrecord/train: 1437 examples" in log
    # The count is given: each worker reads the raw records, decodes only its own.
    assert "shard context (the source shards itself by its input context)" in log
    assert summary["steps"] == 1437 // 64

