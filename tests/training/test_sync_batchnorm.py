"""Synchronized BatchNormalization under tf.distribute equals one device on the global batch.

`keras.layers.BatchNormalization(synchronized=True)` all-reduces each
batch's sum, sum of squares and count, so on N replicas its statistics, its
moving mean and variance, its outputs and the gradients through them are
those of one device with plain BatchNormalization on the whole batch. Checked
after a few SGD steps (every weight, moving statistics included, to 1e-5)
through `tfdp.compile` + `model.fit` and `tfdp.Trainer`, on a 2-replica CPU
`MirroredStrategy` and on 2 worker processes.

With `accum_steps > 1` the statistics are those of each micro-batch: the
global micro-batch `k` is the `k`-th slice of every replica's share
(`tfdp.training.accumulation.split_micro_batches`), and the moving
statistics are updated once per micro-batch. The reference is one device
with `accum_steps` on the same examples grouped the same way. (Accumulation
unrolls its micro-batch loop for such models: the all-reduce inside
synchronized BatchNormalization cannot run in a `tf.while_loop`.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import tfdp
from multiworker import python_command, run_launch

JOB_SCRIPT = Path(__file__).with_name("sync_batchnorm_job.py")
_spec = importlib.util.spec_from_file_location("sync_batchnorm_job", JOB_SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)


def micro_batch_order(replicas, accum_steps, global_batch=job.GLOBAL_BATCH):
    """The global batch's examples in the order of the global micro-batches.

    Replica `r` holds examples `[r * B, (r + 1) * B)` (B = global_batch /
    replicas) and splits them into `accum_steps` contiguous slices; global
    micro-batch `k` is slice `k` of every replica. One device with the same
    `accum_steps` on the batch in this order sees the same micro-batches.
    """
    share = global_batch // replicas
    micro = share // accum_steps
    return [r * share + k * micro + i
            for k in range(accum_steps) for r in range(replicas) for i in range(micro)]


def _train(strategy, *, loop, synchronized, accum_steps=1, order=None):
    with strategy.scope():
        model = job.sync_bn_model(synchronized)
        optimizer = job.optimizer()
        if loop == "fit":
            tfdp.compile(model, optimizer=optimizer, loss=job.loss(), accum_steps=accum_steps)
    if loop == "fit":
        model.fit(job.global_batches(order), epochs=1, verbose=0)
    else:
        batch = tfdp.BatchConfig.from_global(job.GLOBAL_BATCH, strategy.num_replicas_in_sync,
                                             accum_steps)
        tfdp.Trainer(model, optimizer=optimizer, loss=job.loss(), strategy=strategy,
                     batch=batch).train(job.global_batches(order), epochs=1)
    # Keyed by layer and weight name (the model's own name is numbered).
    return {w.path.split("/", 1)[1]: w.numpy() for w in model.weights}


def _one_device(*, loop, accum_steps=1, order=None):
    """Plain BatchNormalization on one device, the same loop and accumulation."""
    return _train(tfdp.make_strategy("default"), loop=loop, synchronized=False,
                  accum_steps=accum_steps, order=order)


def _assert_close(got, want, atol=1e-5):
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, atol=atol, rtol=0, err_msg=path)


@pytest.fixture(scope="module")
def strategy():
    return tfdp.make_strategy(cpu_replicas=2)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_synchronized_bn_on_2_replicas_equals_one_device_on_the_global_batch(strategy, loop):
    _assert_close(_train(strategy, loop=loop, synchronized=True), _one_device(loop=loop))


def test_the_replicas_halves_differ_so_per_replica_statistics_would_not_pass():
    x, _ = job.arrays()
    halves = x.reshape(job.STEPS, 2, job.GLOBAL_BATCH // 2, job.FEATURES)
    # The second replica's share has 3x the spread of the first's (job.arrays).
    assert np.all(halves[:, 1].std(axis=1) > 1.5 * halves[:, 0].std(axis=1))


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_with_accumulation_the_statistics_are_each_micro_batch(strategy, loop):
    accum_steps = 2
    order = micro_batch_order(strategy.num_replicas_in_sync, accum_steps)
    want = _one_device(loop=loop, accum_steps=accum_steps, order=order)
    _assert_close(_train(strategy, loop=loop, synchronized=True, accum_steps=accum_steps), want)
    # Not the statistics of the whole global batch (one update per step).
    whole = _one_device(loop=loop)
    assert np.abs(want["bn/moving_mean"] - whole["bn/moving_mean"]).max() > 0.01


@pytest.mark.slow
def test_synchronized_bn_on_2_worker_processes_equals_one_device(tmp_path):
    result = run_launch(python_command(JOB_SCRIPT, str(tmp_path)), nproc=2, timeout=240,
                        cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    order = micro_batch_order(2, 2)
    want = {"fit": _one_device(loop="fit"), "trainer": _one_device(loop="custom"),
            "accum": _one_device(loop="fit", accum_steps=2, order=order)}
    for rank in range(2):
        with np.load(tmp_path / f"rank{rank}.npz") as data:
            record = dict(data)
        for name, reference in want.items():
            for i, value in enumerate(reference.values()):
                np.testing.assert_allclose(record[f"{name}_weight{i}"], value, atol=1e-5,
                                           rtol=0, err_msg=f"rank {rank} {name} weight {i}")
