"""`tfdp-train --balance_batches`: whole global batches in one seekable order, both loops.

The input of a balanced run is one pipeline of whole global batches, the same
on every worker (`train.whole_global_batches`): checked here for its batch,
its examples (none repeated beyond the split) and its seeks (an epoch entered
at batch b is the uninterrupted epoch from b on). The custom loop trains on 2
logical replicas in-process; the 2-worker fit run with a `model_dir` (its
`BackupAndRestore` input) is in test_train_e2e.py.
"""

import collections
import json

import numpy as np
import pytest

from tfdp.app import train as train_cli


def _batches(dataset):
    return [(np.asarray(x), np.asarray(y)) for x, y in dataset]


def _rows(batches):
    return collections.Counter(x.tobytes() + y.tobytes()
                               for xs, ys in batches for x, y in zip(xs, ys))


@pytest.mark.slow
def test_whole_global_batches_are_every_workers_epoch_and_seek_exactly(tmp_path):
    import tensorflow as tf

    from tfdp import pipelines
    from tfdp.training.batch import BatchConfig

    batch = BatchConfig.from_global(64, 2)  # what two workers of one replica each train on
    arguments = train_cli.whole_global_batches(batch, tf.distribute.get_strategy())
    assert arguments["batch"].global_batch == 64 and arguments["batch"].num_replicas == 1
    options = dict(split="train", seed=3, data_dir=str(tmp_path), preprocess=pipelines.for_images(
        training=True))
    dataset = pipelines.make_dataset("digits", training=True, **options, **arguments)
    assert isinstance(dataset, tf.data.Dataset) and dataset.streams_epochs
    steps = dataset.steps_per_epoch
    assert steps == dataset.num_examples // 64

    epoch_1 = _batches(dataset.epoch_stream(1, num_epochs=1))
    assert len(epoch_1) == steps and {x.shape[0] for x, _ in epoch_1} == {64}
    # Built again (another worker, another attempt): the same batches.
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(epoch_1, _batches(dataset.epoch_stream(1, num_epochs=1))))
    # No example more often than the split holds it: each at most once per epoch.
    split = _rows(_batches(pipelines.make_dataset(
        "digits", training=False, split="train", data_dir=str(tmp_path),
        preprocess=pipelines.for_images(training=False), **arguments)))
    seen = _rows(epoch_1)
    assert sum(seen.values()) == steps * 64
    assert all(count <= split[row] for row, count in seen.items())
    # A resume at batch 7 of epoch 1: the rest of that epoch, then epoch 2, unchanged.
    resumed = _batches(dataset.epoch_stream(1, 7, num_epochs=2))
    straight = epoch_1[7:] + _batches(dataset.epoch_stream(2, num_epochs=1))
    assert len(resumed) == len(straight)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(resumed, straight))
    # The first epoch's own dataset, entered at a batch, seeks the same way.
    epoch_0 = _batches(dataset)
    entered = _batches(dataset.start_at_batch(5))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(entered, epoch_0[5:]))
    assert len(entered) == steps - 5


@pytest.mark.slow
def test_custom_loop_balances_two_replicas(parse_flags, tmp_path):
    """2 logical replicas, 6 steps: the Trainer trained with a plan over the global batch."""
    parse_flags("--model=mlp", "--dataset=digits", f"--data_dir={tmp_path / 'tfds'}",
                "--cpu_replicas=2", "--balance_batches", "--loop=custom", "--epochs=2",
                "--steps_per_epoch=6", "--steps_per_loop=2", "--global_batch=16",
                f"--model_dir={tmp_path / 'run'}")
    train_cli.main(["tfdp-train"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["config"]["balance_batches"]
    assert summary["batch"]["global"] == 16
    balanced = summary["balanced_batches"]
    assert len(balanced["shares"]) == 2 and sum(balanced["shares"]) == 16
    assert all(sum(shares) == 16 for _, shares in balanced["plans"])
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
