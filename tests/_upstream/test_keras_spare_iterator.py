"""Pins tfdp._upstream.keras_spare_iterator to Keras' epoch loop.

Keras builds one more distributed iterator after every full pass of an
input without `steps_per_epoch`, and never uses it. tfdp skips it where
that changes nothing: results, and the order of every later pass, must be
Keras' own.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

import tfdp
from tfdp._upstream import keras_spare_iterator

EXAMPLES, BATCH = 40, 16  # 3 batches, the last one partial


@pytest.fixture
def iterator_builds(monkeypatch):
    """Counts the distributed iterators Keras' epoch loop asks for (`_get_iterator`)."""
    builds = []
    original = keras_tf_trainer.TFEpochIterator._get_iterator

    def counting(self):
        builds.append(self)
        return original(self)

    monkeypatch.setattr(keras_tf_trainer.TFEpochIterator, "_get_iterator", counting)
    yield builds
    keras_spare_iterator.install()


def _arrays():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(EXAMPLES, 4)).astype("float32"),
            rng.integers(0, 3, size=(EXAMPLES,)))


def _dataset(shuffle=False):
    dataset = tf.data.Dataset.from_tensor_slices(_arrays())
    if shuffle:
        dataset = dataset.shuffle(EXAMPLES, seed=7, reshuffle_each_iteration=True)
    return dataset.batch(BATCH)


def _model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _evaluate_twice(strategy, dataset):
    model = _model(strategy)
    return [model.evaluate(dataset, verbose=0, return_dict=True) for _ in range(2)]


@pytest.mark.slow
def test_keras_spare_iterator_is_skipped_and_nothing_else_changes(iterator_builds):
    """Keras builds one iterator more per pass than it reads (the upstream
    behaviour this module exists for); without it the logs are the same."""
    strategy = tfdp.make_strategy(cpu_replicas=2)
    keras_spare_iterator.uninstall()
    keras_logs = _evaluate_twice(strategy, _dataset())
    keras_builds = len(iterator_builds)
    del iterator_builds[:]
    assert keras_spare_iterator.install()
    tfdp_logs = _evaluate_twice(strategy, _dataset())
    assert keras_builds - len(iterator_builds) == 2  # one per pass
    assert tfdp_logs == keras_logs


@pytest.mark.slow
@pytest.mark.parametrize("case", ["reshuffling", "one_replica"])
def test_keras_loop_runs_unchanged_where_skipping_could_matter(iterator_builds, case):
    """A reshuffling input draws a seed per iterator; one replica gains nothing."""
    strategy = (tfdp.make_strategy(cpu_replicas=2) if case == "reshuffling"
                else tf.distribute.get_strategy())
    counts = []
    for install in (keras_spare_iterator.uninstall, keras_spare_iterator.install):
        install()
        del iterator_builds[:]
        _evaluate_twice(strategy, _dataset(shuffle=case == "reshuffling"))
        counts.append(len(iterator_builds))
    assert counts[0] == counts[1]


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True], ids=["fixed_order", "reshuffled"])
def test_fit_with_validation_is_keras_own(iterator_builds, shuffle):
    """Every figure equals Keras' unpatched loop; reshuffled inputs keep every iterator."""
    strategy = tfdp.make_strategy(cpu_replicas=2)
    histories, counts = [], []
    for install in (keras_spare_iterator.uninstall, keras_spare_iterator.install):
        install()
        del iterator_builds[:]
        model = _model(strategy)
        histories.append(model.fit(_dataset(shuffle), validation_data=_dataset(shuffle),
                                   epochs=2, verbose=0).history)
        counts.append(len(iterator_builds))
    assert histories[1] == histories[0]
    # Per epoch: the training pass and the validation pass each skip one.
    assert counts[0] - counts[1] == (0 if shuffle else 4)


@pytest.mark.parametrize("build,draws", [
    (lambda: tf.data.Dataset.range(10).map(lambda x: x * 2).batch(3), False),
    (lambda: _dataset(), False),
    (lambda: _dataset(shuffle=True), True),
    (lambda: tf.data.Dataset.range(10).shuffle(10), True),
    (lambda: tf.data.Dataset.random(seed=1).take(5), True),
    (lambda: tf.data.Dataset.range(4).map(lambda x: tf.random.uniform(()) + tf.cast(x, "float32")),
     True),
    (lambda: tf.data.Dataset.sample_from_datasets([tf.data.Dataset.range(3)] * 2), True),
    # A generator runs at the first read, not when an iterator is built.
    (lambda: tf.data.Dataset.from_generator(lambda: iter(range(3)), output_signature=
                                            tf.TensorSpec((), tf.int64)), False),
])
def test_may_draw_seeds(build, draws):
    assert keras_spare_iterator.may_draw_seeds(build()) is draws


def test_other_keras_versions_are_left_alone():
    assert keras_spare_iterator.is_supported("3.15.1")
    assert not keras_spare_iterator.is_supported("3.16.0")
    assert not keras_spare_iterator.is_supported("2.15.0")


class _StandInEpochIterator:
    """What `_kept_passes` reads of a `TFEpochIterator`: 5 batches, 2 per call."""

    steps_per_execution, _num_batches = 2, 5

    def __init__(self):
        self.data_adapter = self
        self._distribute_strategy = self
        self.distributed = []

    def get_tf_dataset(self):
        return tf.data.Dataset.range(self._num_batches)

    def experimental_distribute_dataset(self, dataset):
        self.distributed.append(dataset)
        return dataset


def _keras_pass(iterator):
    """Keras' loop for one pass of `_StandInEpochIterator` (what it yields, in order)."""
    current = iter(iterator._get_iterator())
    for step in range(0, iterator._num_batches, iterator.steps_per_execution):
        yield step, step + iterator.steps_per_execution - 1, current


def _read_pass(iterator, stop_after=None):
    """Runs one pass as a bounded multi-step function would; the batches it read."""
    read = []
    passes = keras_spare_iterator._kept_passes(iterator, _keras_pass(iterator))
    for calls, (_, _, batches) in enumerate(passes):
        steps = iterator.steps_per_execution
        if isinstance(batches, keras_spare_iterator._keras_train_function.StepBound):
            batches, steps = batches.iterator, batches.steps
        read += [int(next(batches)) for _ in range(steps)]
        if stop_after is not None and calls + 1 == stop_after:
            passes.close()  # what `break` in Keras' evaluate does
            break
    return read


def test_a_kept_iterator_reads_each_pass_whole_and_a_stopped_pass_starts_over():
    iterator = _StandInEpochIterator()
    # The last call of each pass is bounded to the pass's one remaining batch.
    assert _read_pass(iterator) == [0, 1, 2, 3, 4]
    assert _read_pass(iterator) == [0, 1, 2, 3, 4]
    assert len(iterator.distributed) == 1  # one iterator served both passes
    assert _read_pass(iterator, stop_after=1) == [0, 1]  # stopped part-way: dropped
    assert "_get_iterator" not in vars(iterator)
    assert _read_pass(iterator) == [0, 1, 2, 3, 4]
    assert len(iterator.distributed) == 2
