"""tfdp.compile and tfdp.Trainer on two real MultiWorkerMirroredStrategy workers.

One launch (`multiworker_training_job.py`) trains with accumulation through
`model.fit`, trains-stops-resumes with `Trainer`, and evaluates a padded set;
every result is compared with one device on the same global batches.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from multiworker import python_command, run_launch

import tfdp

JOB_SCRIPT = Path(__file__).with_name("multiworker_training_job.py")
_spec = importlib.util.spec_from_file_location("multiworker_training_job", JOB_SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("mw_training")
    result = run_launch(python_command(JOB_SCRIPT, str(out)), nproc=2, timeout=240, cwd=out)
    assert result.returncode == 0, result.describe()
    print(f"2-worker training job: {result.elapsed:.1f} s")
    records = []
    for rank in range(2):
        with np.load(out / f"rank{rank}.npz") as data:
            records.append(dict(data))
    return out, records


def _keras_reference(epochs_and_steps):
    """One device, no accumulation, Keras fit over the same global batches."""
    model = job.build_model()
    model.compile(optimizer=job.optimizer(), loss=job.loss(), metrics=["accuracy"])
    for epoch, steps in epochs_and_steps:
        model.fit(job.global_batches(epoch).take(steps), epochs=1, verbose=0)
    return model


def test_fit_with_accumulation_on_two_workers_equals_one_device(workers):
    _, records = workers
    reference = _keras_reference([(0, 6)])
    for record in records:
        assert int(record["fit_iterations"]) == 6
        for i, want in enumerate(reference.get_weights()):
            np.testing.assert_allclose(record[f"fit_weight{i}"], want, atol=1e-5, rtol=0)


def test_trainer_resumed_on_two_workers_equals_one_device(workers):
    out, records = workers
    # 9 steps at 6 per epoch: all of epoch 0, then 3 steps of epoch 1.
    reference = _keras_reference([(0, 6), (1, 3)])
    for record in records:
        assert int(record["trainer_steps"]) == job.TOTAL_STEPS
        for i, want in enumerate(reference.get_weights()):
            np.testing.assert_allclose(record[f"trainer_weight{i}"], want, atol=1e-5, rtol=0)
    # Only the chief wrote into model_dir, and the last checkpoint is the end.
    model_dir = out / "model_dir"
    assert tf.train.latest_checkpoint(str(model_dir)).endswith(f"ckpt-{job.TOTAL_STEPS}")
    assert sorted(p.name for p in model_dir.iterdir() if p.is_dir()) == ["train"]


def test_evaluate_on_two_workers_is_exact(workers):
    _, records = workers
    reference = _keras_reference([(0, 6), (1, 3)])
    x, y = job.arrays(job.EVAL_EXAMPLES, seed=1)
    logits = reference(x, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y))
    loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)))
    for record in records:
        assert float(record["eval_accuracy"]) == pytest.approx(accuracy, abs=1e-6)
        assert float(record["eval_loss"]) == pytest.approx(loss, rel=1e-5)
