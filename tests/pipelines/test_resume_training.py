"""Resuming `fit` (BackupAndRestore) and `tfdp.Trainer` late in an epoch of `make_dataset`.

Reference checks on 2 logical CPU replicas: the resumed run ends with the
weights of an uninterrupted run and trains on the same examples (recorded
inside the train step), and its input pipeline preprocesses only the
examples after the position (a counting `preprocess`): the seek of
`tfdp.training.input_position` through `make_dataset(...).start_at_batch`.
"""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import pipelines
from tfdp.callbacks import BackupAndRestore
from tfdp.pipelines.source import Source
from pipeline_testing import get_strategy

NUM_EXAMPLES, GLOBAL_BATCH, EPOCHS = 96, 8, 1
STEPS_PER_EPOCH = NUM_EXAMPLES // GLOBAL_BATCH  # 12
TOTAL = EPOCHS * STEPS_PER_EPOCH
STOP_AT = TOTAL - 2  # batch 10 of 12: late in the epoch


class Examples(Source):
    """Example `i`: features `[i, sin i, cos i]`, label `i % 3`; addressable by index."""

    name = "examples"

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        return tf.data.Dataset.range(NUM_EXAMPLES).map(self.example_at(split))

    def example_at(self, split):
        def example(i):
            x = tf.cast(i, tf.float32)
            return tf.stack([x, tf.sin(x), tf.cos(x)]), i % 3

        return example

    def num_examples(self, split):
        return NUM_EXAMPLES


class Recorder:
    """Ids the model trained on, and the preprocess calls of the pipelines."""

    def __init__(self):
        self.seen: list[int] = []
        self.preprocessed: list[int] = []

    def record(self, ids):
        self.seen.extend(int(i) for i in ids.numpy())

    def _preprocessed(self, i):
        self.preprocessed.append(int(i.numpy()))

    def preprocess(self, features, label):
        tf.py_function(self._preprocessed, [tf.cast(features[0], tf.int64)], [])
        return features, label


def _datasets(strategy, recorder: Recorder):
    def dataset_for_epoch(epoch):
        return pipelines.make_dataset(
            Examples(), strategy=strategy, global_batch=GLOBAL_BATCH, seed=10 + epoch,
            preprocess=recorder.preprocess)

    return dataset_for_epoch


def _model(strategy, recorder: Recorder, seed: int):
    class IdRecorder(keras.layers.Layer):
        def call(self, inputs, training=None):
            if training:
                tf.py_function(recorder.record, [tf.cast(inputs[:, 0], tf.int64)], [])
            return inputs[:, 1:]

        def compute_output_shape(self, input_shape):
            return (input_shape[0], input_shape[1] - 1)

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((3,)), IdRecorder(), keras.layers.Dense(3)])
    return model


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Interrupted(Exception):
    pass


class InterruptAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= STOP_AT:
            raise Interrupted()


def _fit(strategy, recorder, backup_dir, seed, callbacks=()):
    model = _model(strategy, recorder, seed)
    with strategy.scope():
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=_loss())
    backup = BackupAndRestore(backup_dir, save_freq=2)
    keras.utils.set_random_seed(0)  # the same global seed whenever datasets are built
    model.fit(backup.wrap(_datasets(strategy, recorder)), epochs=EPOCHS, verbose=0,
              callbacks=[backup, *callbacks])
    return model


def _trainer(strategy, recorder, model_dir, seed):
    model = _model(strategy, recorder, seed)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    return tfdp.Trainer(model, optimizer=optimizer, loss=_loss(), strategy=strategy,
                        batch=tfdp.BatchConfig.from_global(GLOBAL_BATCH, 2),
                        model_dir=model_dir, checkpoint_every=2)


def _train(strategy, recorder, model_dir, seed, steps):
    trainer = _trainer(strategy, recorder, model_dir, seed)
    keras.utils.set_random_seed(0)
    trainer.train(_datasets(strategy, recorder), steps=steps)
    return trainer.model


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "trainer"])
def test_a_late_resume_preprocesses_nothing_it_skips_and_ends_as_uninterrupted(loop, tmp_path):
    strategy = get_strategy("mirrored2")
    straight, first, second = Recorder(), Recorder(), Recorder()
    if loop == "fit":
        want = _fit(strategy, straight, str(tmp_path / "straight"), seed=1)
        with pytest.raises(Interrupted):
            _fit(strategy, first, str(tmp_path / "resumed"), seed=1, callbacks=[InterruptAt()])
        got = _fit(strategy, second, str(tmp_path / "resumed"), seed=2)
    else:
        want = _train(strategy, straight, str(tmp_path / "straight"), seed=1, steps=TOTAL)
        _train(strategy, first, str(tmp_path / "resumed"), seed=1, steps=STOP_AT)
        got = _train(strategy, second, str(tmp_path / "resumed"), seed=2, steps=TOTAL)

    for w, g in zip(want.get_weights(), got.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    # The resumed run trained on the examples the uninterrupted one did from
    # step STOP_AT on, and preprocessed those only: none of the 10 batches
    # of the epoch before the position. (fit reads one batch before training
    # to build the model, from a dataset of its own: at most the 2 batches
    # left are preprocessed twice.)
    rest = straight.seen[STOP_AT * GLOBAL_BATCH:]
    assert collections.Counter(second.seen) == collections.Counter(rest)
    assert len(rest) == 2 * GLOBAL_BATCH
    assert set(second.preprocessed) == set(rest)
    calls = len(second.preprocessed)
    assert calls == len(rest) if loop == "trainer" else len(rest) <= calls <= 2 * len(rest)
    # Each example once per epoch, across the interruption.
    assert sorted(first.seen[:STOP_AT * GLOBAL_BATCH] + second.seen) == list(range(NUM_EXAMPLES))


STREAM_EPOCHS, STREAM_EXECUTION = 3, 5  # 12 steps an epoch: executions of 5, 5 and 2


class StreamInUse(keras.callbacks.Callback):
    """Records, at every epoch's end, the iterator the wrapped input's epochs ran on."""

    def __init__(self, fit_input):
        super().__init__()
        self.fit_input = fit_input
        self.iterators = []

    def on_epoch_end(self, epoch, logs=None):
        self.iterators.append(self.fit_input._stream_iterator)  # pylint: disable=protected-access


def _fit_stream(strategy, recorder, backup_dir, seed, callbacks=()):
    """`fit` on `backup.wrap(make_dataset(...))`: one dataset carries every epoch."""
    model = _model(strategy, recorder, seed)
    with strategy.scope():
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=_loss(),
                     steps_per_execution=STREAM_EXECUTION)
    backup = BackupAndRestore(backup_dir, save_freq=STREAM_EXECUTION)
    keras.utils.set_random_seed(0)
    dataset = pipelines.make_dataset(Examples(), strategy=strategy, global_batch=GLOBAL_BATCH,
                                     seed=10, preprocess=recorder.preprocess)
    assert dataset.streams_epochs
    fit_input = backup.wrap(dataset)
    in_use = StreamInUse(fit_input)
    model.fit(fit_input, epochs=STREAM_EPOCHS, verbose=0,
              callbacks=[backup, in_use, *callbacks])
    return model, in_use.iterators


class InterruptAtStep(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.step:
            raise Interrupted()


@pytest.mark.slow
def test_fit_on_one_epoch_stream_stops_each_epoch_at_its_end_and_resumes_exactly(tmp_path):
    strategy = get_strategy("mirrored2")
    straight, first, second = Recorder(), Recorder(), Recorder()
    want, iterators = _fit_stream(strategy, straight, str(tmp_path / "straight"), seed=1)
    # Every epoch ran on one iterator, and stopped at its own last batch
    # though executions of 5 do not divide its 12 steps.
    assert iterators[0] is not None and len(iterators) == STREAM_EPOCHS
    assert all(i is iterators[0] for i in iterators)
    assert int(want.optimizer.iterations.numpy()) == STREAM_EPOCHS * STEPS_PER_EPOCH
    epochs = [straight.seen[e * NUM_EXAMPLES:(e + 1) * NUM_EXAMPLES]
              for e in range(STREAM_EPOCHS)]
    assert all(sorted(seen) == list(range(NUM_EXAMPLES)) for seen in epochs)
    assert epochs[0] != epochs[1] != epochs[2]

    # Interrupted in epoch 1 (after its second execution, step 22), resumed by
    # a fresh model from the last backup: the weights of the straight run.
    with pytest.raises(Interrupted):
        _fit_stream(strategy, first, str(tmp_path / "resumed"), seed=1,
                    callbacks=[InterruptAtStep(STEPS_PER_EPOCH + 2 * STREAM_EXECUTION)])
    got, _ = _fit_stream(strategy, second, str(tmp_path / "resumed"), seed=2)
    assert int(got.optimizer.iterations.numpy()) == STREAM_EPOCHS * STEPS_PER_EPOCH
    for w, g in zip(want.get_weights(), got.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    # The backup at step 20 was written at the end of the execution that
    # reached it (step 22: epoch 1, batch 10), so the resumed run starts
    # with a bounded execution of 2 steps, and trains on the straight run's
    # examples from there on.
    resumed_at = STEPS_PER_EPOCH + 2 * STREAM_EXECUTION
    assert second.seen == straight.seen[resumed_at * GLOBAL_BATCH:]


def _train_stream(strategy, recorder, model_dir, seed, steps):
    """`Trainer.train(make_dataset(...))` with a seed: one stream for every epoch.

    Returns the model and how many streams the call opened."""
    model = _model(strategy, recorder, seed)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss=_loss(), strategy=strategy,
                           batch=tfdp.BatchConfig.from_global(GLOBAL_BATCH, 2),
                           model_dir=model_dir, checkpoint_every=STREAM_EXECUTION,
                           steps_per_loop=STREAM_EXECUTION)
    keras.utils.set_random_seed(0)
    dataset = pipelines.make_dataset(Examples(), strategy=strategy, global_batch=GLOBAL_BATCH,
                                     seed=10, preprocess=recorder.preprocess)
    opened = []
    epoch_stream = dataset.epoch_stream

    def counted(*args, **kwargs):
        opened.append(args)
        return epoch_stream(*args, **kwargs)

    dataset.epoch_stream = counted
    trainer.train(dataset, steps=steps)
    assert trainer.global_step == steps
    return model, opened


@pytest.mark.slow
def test_the_trainer_runs_every_epoch_on_one_stream_and_resumes_exactly(tmp_path):
    strategy = get_strategy("mirrored2")
    straight, first, second = Recorder(), Recorder(), Recorder()
    total = STREAM_EPOCHS * STEPS_PER_EPOCH
    want, opened = _train_stream(strategy, straight, str(tmp_path / "straight"), 1, total)
    assert opened == [(0, 0)]
    epochs = [straight.seen[e * NUM_EXAMPLES:(e + 1) * NUM_EXAMPLES]
              for e in range(STREAM_EPOCHS)]
    assert all(sorted(seen) == list(range(NUM_EXAMPLES)) for seen in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    # The fit test's order: the same dataset gives the same epochs either way.
    stop = STEPS_PER_EPOCH + 2 * STREAM_EXECUTION  # epoch 1, batch 10: its last execution
    _train_stream(strategy, first, str(tmp_path / "resumed"), 1, stop)
    got, opened = _train_stream(strategy, second, str(tmp_path / "resumed"), 2, total)
    assert opened == [(1, 2 * STREAM_EXECUTION)]
    for w, g in zip(want.get_weights(), got.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    assert first.seen + second.seen == straight.seen


@pytest.mark.slow
def test_class_weight_reaches_a_wrapped_stream_as_keras_applies_it_to_that_epoch(tmp_path):
    # Under the default strategy each epoch is a tf.data.Dataset, which Keras
    # maps with the class weights; the wrapped input must do the same.
    strategy = get_strategy("default")
    class_weight = {0: 0.0, 1: 3.0, 2: 1.0}
    dataset = pipelines.make_dataset(Examples(), strategy=strategy, global_batch=GLOBAL_BATCH,
                                     seed=10)
    weights = []
    for how in ("keras", "wrapped", "unweighted"):
        model = _model(strategy, Recorder(), seed=1)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=_loss())
        if how == "keras":
            model.fit(dataset.epoch_stream(0, num_epochs=1), epochs=1, verbose=0,
                      class_weight=class_weight)
        else:
            backup = BackupAndRestore(str(tmp_path / how))
            model.fit(backup.wrap(dataset), epochs=1, verbose=0, callbacks=[backup],
                      class_weight=class_weight if how == "wrapped" else None)
        weights.append(model.get_weights())
    keras_weights, wrapped, unweighted = weights
    for got, want in zip(wrapped, keras_weights):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert any(not np.allclose(u, w) for u, w in zip(unweighted, keras_weights))
