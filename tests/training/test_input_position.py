"""tfdp.training.input_position: how a resumed epoch is entered, and what it reads.

Also `tfdp.Trainer` on a dataset of unknown size: epochs end where the data
ends, and a resume re-reads at most the current epoch (counted in the
dataset's own map), ending with the weights of an uninterrupted run.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import input_position
from tfdp.training.batch import BatchConfig
from tfdp.training.trainer import Trainer

FEATURES, CLASSES, GLOBAL_BATCH = 4, 3, 8


def _counted_batches(counter: tf.Variable, num_batches: int = 6) -> tf.data.Dataset:
    """Batches 0..n-1 of 1 example each, counting every element the pipeline produces."""

    def count(i):
        counter.assign_add(1)
        return i

    return tf.data.Dataset.range(num_batches).map(count).batch(1)


class _Seekable:
    """A dataset wrapper that records where it was entered."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.entered_at = None

    def start_at_batch(self, batch):
        self.entered_at = batch
        return self.dataset.skip(batch)  # stands for a pipeline that computes its position


def test_a_dataset_with_start_at_batch_is_entered_by_it():
    counter = tf.Variable(0, dtype=tf.int64)
    seekable = _Seekable(_counted_batches(counter))
    dataset, left = input_position.start_at_batch(seekable, 4)
    assert seekable.entered_at == 4 and left == 0
    assert [int(b[0]) for b in dataset] == [4, 5]
    # Batch 0 needs no seek: the dataset is used as it is.
    assert input_position.start_at_batch(seekable, 0) == (seekable, 0)


def test_a_plain_dataset_is_skipped_reading_what_it_skips():
    counter = tf.Variable(0, dtype=tf.int64)
    dataset, left = input_position.start_at_batch(_counted_batches(counter), 4)
    assert left == 0
    assert [int(b[0]) for b in dataset] == [4, 5]
    assert int(counter.numpy()) == 6  # the 4 skipped batches went through the map


def test_a_distributed_dataset_leaves_the_skip_to_its_iterator():
    strategy = tfdp.make_strategy(cpu_replicas=2)
    distributed = strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(12).batch(2))
    dataset, left = input_position.start_at_batch(distributed, 3)
    assert dataset is distributed and left == 3


def test_start_at_batch_must_return_a_dataset():
    class Broken:
        def start_at_batch(self, batch):
            return [batch]

    with pytest.raises(TypeError, match="must return a tf.data.Dataset"):
        input_position.start_at_batch(Broken(), 2)


# --- Trainer on a dataset of unknown size -----------------------------------

NUM_EXAMPLES = 48  # kept by the filter: all; 6 global batches per epoch


def _unknown_size_epoch(counter: tf.Variable):
    """`epoch -> dataset` of unknown cardinality whose order depends on the epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(NUM_EXAMPLES,)).astype("int32")

    def count(features, label):
        counter.assign_add(1)
        return features, label

    def dataset_for_epoch(epoch):
        order = np.random.default_rng(100 + epoch).permutation(NUM_EXAMPLES)
        return (tf.data.Dataset.from_tensor_slices((x[order], y[order]))
                .map(count).filter(lambda features, label: True)
                .batch(GLOBAL_BATCH, drop_remainder=True))

    return dataset_for_epoch


def _trainer(strategy, model_dir, **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return Trainer(
        model, optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy,
        batch=BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync),
        model_dir=model_dir, **kwargs)


@pytest.mark.slow
def test_unknown_size_resume_rereads_only_the_current_epoch(tmp_path):
    strategy = tfdp.make_strategy("default")
    counter = tf.Variable(0, dtype=tf.int64)
    dataset_for_epoch = _unknown_size_epoch(counter)
    assert int(dataset_for_epoch(0).cardinality()) == tf.data.UNKNOWN_CARDINALITY
    total = 16  # 6-step epochs: two epochs, then 4 steps of the third

    straight = _trainer(strategy, str(tmp_path / "straight"))
    logs = straight.train(dataset_for_epoch, steps=total)
    assert logs["steps"] == total and logs["epochs"] == 2.0

    first = _trainer(strategy, str(tmp_path / "resumed"), checkpoint_every=7)
    first.train(dataset_for_epoch, steps=14)  # saved at 7 and at 14: epoch 2, its batch 2
    counter.assign(0)
    second = _trainer(strategy, str(tmp_path / "resumed"), checkpoint_every=7)
    second.train(dataset_for_epoch, steps=total)
    assert second.global_step == total
    # The resume read epoch 2's first 2 batches again, not the 14 batches since step 0,
    # then the 4 batches it trained (the pipeline may read a little ahead).
    assert 6 * GLOBAL_BATCH >= int(counter.numpy()) >= 6 * GLOBAL_BATCH - 2 * GLOBAL_BATCH
    for want, got in zip(straight.model.weights, second.model.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


def test_unknown_size_epoch_without_a_batch_is_refused(tmp_path):
    strategy = tfdp.make_strategy("default")
    trainer = _trainer(strategy, None)
    empty = tf.data.Dataset.from_tensor_slices(
        (np.zeros((0, FEATURES), "float32"), np.zeros((0,), "int32"))
    ).filter(lambda features, label: True).batch(GLOBAL_BATCH)
    with pytest.raises(ValueError, match="yielded no batch"):
        trainer.train(lambda epoch: empty, steps=3)
