"""`make_dataset(...).start_at_batch(b)`: a resumed epoch seeks instead of re-reading.

Reference checks: the epoch entered at batch `b` yields exactly the batches
the uninterrupted epoch yields from `b` on, and the examples before `b` are
never parsed (decoded) or preprocessed: both are counted in the pipeline, by
a counting `parse` of the records and a counting `preprocess`. Also the new
order's own guarantees: each example once per epoch across input pipelines
(by file and by element), a new order every epoch, and windows of files
before the position never opened.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import pipelines
from tfdp.pipelines import input_pipeline as pipeline_lib
from tfdp.training import batch as batch_lib
from tfdp.pipelines import seekable_order
from tfdp.pipelines.source import RecordFile, Source
from pipeline_testing import collect, get_strategy, id_dataset, real_ids

#: Records per file of the TFRecord id source: uneven on purpose.
FILE_SIZES = (10, 7, 12, 9, 11, 8, 10, 13)
NUM_IDS = sum(FILE_SIZES)  # 80


def _write_id_files(directory) -> list[str]:
    """`FILE_SIZES` files of records `{"id": i}`, ids in file order."""
    paths, next_id = [], 0
    for index, size in enumerate(FILE_SIZES):
        path = os.path.join(directory, f"ids-{index:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(next_id, next_id + size):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))
                })).SerializeToString())
        next_id += size
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def id_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("id_records")
    _write_id_files(str(directory))
    return str(directory)


class Counter:
    """A `tf.Variable` counting calls from inside tf.data functions."""

    def __init__(self):
        self.variable = tf.Variable(0, dtype=tf.int64)

    def __call__(self, *tensors):
        self.variable.assign_add(1)
        return tensors

    def reset(self):
        self.variable.assign(0)

    @property
    def count(self) -> int:
        return int(self.variable.numpy())


def _tfrecord_ids(directory, parses: Counter):
    def parse(serialized):
        parses(serialized)
        i = tf.io.parse_single_example(
            serialized, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]
        return i, i % 10

    return pipelines.TFRecordSource(files={"train": os.path.join(directory, "ids-*.tfrecord")},
                                    parse=parse)


class IndexedIds(Source):
    """Example `i` is `(i, i % 10)`, addressable by index; counts what it builds."""

    name = "indexed_ids"

    def __init__(self, num_examples: int, builds: Counter):
        self._num_examples = num_examples
        self._builds = builds

    def read(self, split, *, input_context=None, shuffle_files=False, seed=None):
        return tf.data.Dataset.range(self._num_examples).map(self.example_at(split))

    def example_at(self, split):
        def example(i):
            self._builds(i)
            return i, i % 10

        return example

    def num_examples(self, split):
        return self._num_examples


def _source(kind: str, id_files, reads: Counter):
    if kind == "tfrecord":
        return _tfrecord_ids(id_files, reads)
    if kind == "indexed":
        return IndexedIds(NUM_IDS, reads)
    return id_dataset(NUM_IDS)  # any tf.data.Dataset: the generic path


def _counted_dataset(kind: str, strategy, id_files):
    """`make_dataset` over `kind` (global batch 8, seed 5), its reads and preprocess
    calls counted: `(dataset, reads, preprocessed)`."""
    reads, preprocessed = Counter(), Counter()
    dataset = pipelines.make_dataset(
        _source(kind, id_files, reads), strategy=strategy, global_batch=8, seed=5,
        preprocess=lambda features, label: preprocessed(features, label))
    return dataset, reads, preprocessed


# One pipeline; one pipeline per replica (by element: the TFRecord files split
# unevenly); one pipeline feeding 2 replicas; and the generic path.
CASES = [
    ("indexed", "mirrored2"), ("indexed", "multiworker_local2"),
    ("tfrecord", "default"), ("tfrecord", "mirrored2"), ("dataset", "mirrored2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,strategy_name", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_a_resumed_epoch_is_the_rest_of_the_epoch_and_preprocesses_only_it(
        kind, strategy_name, id_files):
    strategy = get_strategy(strategy_name)
    dataset, reads, preprocessed = _counted_dataset(kind, strategy, id_files)
    steps = dataset.steps_per_epoch  # 10
    full = real_ids(collect(dataset, strategy))
    assert sorted(full) == sorted(set(full)) and len(full) == steps * 8

    late = steps - 2  # a resume at 80% of the epoch
    reads.reset()
    preprocessed.reset()
    resumed_dataset = dataset.start_at_batch(late)
    rest = collect(resumed_dataset, strategy)
    assert len(rest) == steps - late == batch_lib.num_batches(resumed_dataset)
    assert real_ids(rest) == full[late * 8:]
    # Nothing before the position is preprocessed, whatever the source.
    assert preprocessed.count == 2 * 8
    if kind != "dataset":  # and nothing before it parsed or built
        assert reads.count == 2 * 8


@pytest.mark.slow
def test_entering_at_the_end_or_beyond(id_files):
    strategy = get_strategy("default")
    dataset = pipelines.make_dataset(_tfrecord_ids(id_files, Counter()), strategy=strategy,
                                     global_batch=8, seed=1)
    assert collect(dataset.start_at_batch(dataset.steps_per_epoch), strategy) == []
    with pytest.raises(ValueError, match="at most the 10 batches"):
        dataset.start_at_batch(11)
    # Entering twice adds up.
    twice = dataset.start_at_batch(3).start_at_batch(4)
    assert real_ids(collect(twice, strategy)) == real_ids(collect(dataset, strategy))[56:]


@pytest.mark.slow
@pytest.mark.parametrize("kind,num_pipelines,num_replicas",
                         [("tfrecord", 2, 2), ("tfrecord", 3, 3), ("indexed", 2, 4)])
def test_pipelines_partition_the_epoch_and_each_resumes_alone(
        kind, num_pipelines, num_replicas, id_files):
    # As a MultiWorkerMirroredStrategy does, in separate processes: each
    # pipeline is built from its own input context.
    pipeline = pipeline_lib.InputPipeline(
        source=pipelines.get_source(_source(kind, id_files, Counter())), split="train",
        batch=tfdp.BatchConfig.from_global(6 * num_replicas, num_replicas), training=True,
        shuffle=True, seed=4, shard_policy="auto", drop_remainder=True, cache=False,
        preprocess=None)
    contexts = [tf.distribute.InputContext(num_pipelines, i, num_replicas)
                for i in range(num_pipelines)]
    plan, info = pipeline.plan(num_pipelines, num_replicas)
    assert pipeline.seekable(plan.mode)
    ids, resumed = [], []
    for context in contexts:
        mine = [int(i) for features, _ in pipeline(context) for i in features]
        late = info.steps_per_epoch - 1
        rest = [int(i) for features, _ in pipeline.build(context, start_batch=late)
                for i in features]
        per_step = len(mine) // info.steps_per_epoch
        assert rest == mine[late * per_step:]
        ids.extend(mine)
        resumed.extend(rest)
    assert len(ids) == len(set(ids)) == info.examples_per_epoch
    assert NUM_IDS - len(ids) == info.dropped_per_epoch
    # 8 files: 2 pipelines get 4 each; 3 would lose a step, so by element.
    assert plan.mode == ("file" if kind == "tfrecord" and num_pipelines == 2 else "data")


@pytest.mark.slow
def test_every_epoch_has_a_new_order_and_a_seed_repeats_it(id_files):
    strategy = get_strategy("default")

    def epochs(seed):
        dataset = pipelines.make_dataset(_tfrecord_ids(id_files, Counter()),
                                         strategy=strategy, global_batch=8, seed=seed)
        return [real_ids(collect(dataset, strategy)) for _ in range(2)]

    first, second = epochs(seed=7)
    assert first != second and first != sorted(first)
    assert epochs(seed=7) == [first, second]
    assert epochs(seed=8)[0] != first


@pytest.mark.slow
def test_random_preprocessing_of_a_resumed_epoch_is_the_uninterrupted_one(digits_dir):
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(
        "digits", data_dir=digits_dir, strategy=strategy, global_batch=64, seed=2,
        preprocess=pipelines.for_images(training=True, augment=True))
    assert dataset.pipeline_info.shard_mode == "file"
    full = collect(dataset, strategy)
    late = dataset.steps_per_epoch - 3
    rest = collect(dataset.start_at_batch(late), strategy)
    assert len(rest) == 3
    for want, got in zip(full[late:], rest):
        for (want_x, want_y), (got_x, got_y) in zip(want, got):
            np.testing.assert_array_equal(got_x, want_x)
            np.testing.assert_array_equal(got_y, want_y)


def test_windows_of_files_before_the_position_are_not_opened(tmp_path):
    paths = _write_id_files(str(tmp_path))
    files = [RecordFile(p, 0, n) for p, n in zip(paths, FILE_SIZES)]
    parse = lambda s: (tf.io.parse_single_example(  # noqa: E731
        s, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"], tf.constant(0, tf.int64))
    order = seekable_order.SeekableOrder(
        files=files, parse=parse, residue=None, shuffle=False, unit_seed=None,
        example_seed=None, window_examples=10)  # one file per window
    assert order.files_per_window == 1
    start = sum(FILE_SIZES[:3]) + 4  # inside the fourth file
    for path in paths[:3]:
        os.remove(path)  # opening one now would fail
    ids = [int(example[0]) for example, _ in order.dataset(start, NUM_IDS)]
    assert ids == list(range(start, NUM_IDS))


def test_a_tfds_split_slice_reads_only_its_records(digits_dir):
    source = pipelines.get_source("digits", data_dir=digits_dir)
    files = source.record_files("train[10:30]")
    assert sum(f.take for f in files) == 20
    strategy = get_strategy("default")
    dataset = pipelines.make_dataset("digits", split="train[10:30]", data_dir=digits_dir,
                                     strategy=strategy, global_batch=4, seed=0)
    images = np.concatenate([step[0][0] for step in collect(dataset, strategy)])
    want = np.stack([x for x, _ in source.read("train[10:30]").as_numpy_iterator()])
    assert sorted(map(bytes, images.reshape(20, -1))) == sorted(map(bytes, want.reshape(20, -1)))


STREAM_CASES = [("tfrecord", "mirrored2"), ("indexed", "multiworker_local2"),
                ("tfrecord", "default")]


@pytest.mark.slow
@pytest.mark.parametrize("kind,strategy_name", STREAM_CASES,
                         ids=[f"{k}-{s}" for k, s in STREAM_CASES])
def test_one_stream_carries_every_epoch_and_enters_at_any_epoch_and_batch(
        kind, strategy_name, id_files):
    strategy = get_strategy(strategy_name)
    dataset, reads, preprocessed = _counted_dataset(kind, strategy, id_files)
    assert dataset.streams_epochs
    steps = dataset.steps_per_epoch  # 10
    stream = real_ids(collect(dataset.epoch_stream(0, num_epochs=3), strategy))
    epochs = [stream[e * steps * 8:(e + 1) * steps * 8] for e in range(3)]
    assert len(stream) == 3 * steps * 8
    for ids in epochs:  # each epoch: every example once, none of the dropped ones twice
        assert len(ids) == len(set(ids)) == steps * 8
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != sorted(epochs[0])

    # Entered at (epoch 1, batch 4), built anew: the rest of the same stream,
    # and nothing before the position preprocessed (or parsed, or built).
    reads.reset()
    preprocessed.reset()
    rest = real_ids(collect(dataset.epoch_stream(1, 4, num_epochs=2), strategy))
    assert rest == stream[(steps + 4) * 8:]
    assert preprocessed.count == reads.count == len(rest)
    # Fewer steps per epoch: each epoch's first batches of the same order.
    short = real_ids(collect(dataset.epoch_stream(1, steps_per_epoch=3, num_epochs=2),
                             strategy))
    assert short == epochs[1][:3 * 8] + epochs[2][:3 * 8]
    # Endless without num_epochs.
    endless = iter(dataset.epoch_stream(0))
    for _ in range(3 * steps + 2):
        next(endless)


@pytest.mark.slow
def test_a_stream_needs_a_seed_and_whole_batches(id_files):
    strategy = get_strategy("default")
    source = _tfrecord_ids(id_files, Counter())
    for dataset in (pipelines.make_dataset(source, strategy=strategy, global_batch=8),
                    pipelines.make_dataset(source, strategy=strategy, global_batch=8, seed=1,
                                           drop_remainder=False)):
        assert not dataset.streams_epochs
        with pytest.raises(ValueError, match="needs training=True with a `seed`"):
            dataset.epoch_stream(0)
    seeded = pipelines.make_dataset(source, strategy=strategy, global_batch=8, seed=1)
    with pytest.raises(ValueError, match=r"steps_per_epoch.*must be in \[1, 10\]"):
        collect(seeded.epoch_stream(0, steps_per_epoch=11, num_epochs=1), strategy)


def test_a_stream_converts_your_preprocess_with_autograph(digits_dir):
    # The stream's own epoch function is not converted by autograph (it was 1-3 s
    # of every build); a preprocess of yours still is, as in every other map:
    # this one branches on a tensor with a Python `if`.
    def label_parity_image(features, label):
        if label % 2 == 0:
            features = tf.zeros_like(features)
        return features, label

    strategy = get_strategy("default")
    dataset = pipelines.make_dataset("digits", data_dir=digits_dir, strategy=strategy,
                                     global_batch=32, seed=3, preprocess=label_parity_image)
    batches = collect(dataset.epoch_stream(0, steps_per_epoch=4, num_epochs=2), strategy)
    assert len(batches) == 8
    for (x, y), in batches:
        assert x.shape == (32, 8, 8, 1)
        even = y % 2 == 0
        assert even.any() and (~even).any()
        assert not x[even].any() and x[~even].any(axis=(1, 2, 3)).all()


# Each strategy kind whose input pipelines make_dataset plans without building.
PLANNED_CASES = ["default", "one_device", "mirrored2", "multiworker_local2"]


@pytest.mark.parametrize("strategy_name", PLANNED_CASES)
def test_a_planned_dataset_builds_nothing_until_asked_then_what_make_dataset_builds(
        strategy_name, monkeypatch):
    strategy = get_strategy(strategy_name)
    built = []
    build = pipeline_lib.InputPipeline.build
    monkeypatch.setattr(pipeline_lib.InputPipeline, "build",
                        lambda self, *a, **k: built.append(1) or build(self, *a, **k))

    def make(**kwargs):
        return pipelines.make_dataset(IndexedIds(37, Counter()), strategy=strategy,
                                      global_batch=8, seed=3, **kwargs)

    eager = make()
    built.clear()
    planned = make(distribute=False)
    assert isinstance(planned, pipelines.PlannedDataset)
    assert not built, "planning built an input pipeline"
    assert planned.pipeline_info == eager.pipeline_info
    assert (planned.steps_per_epoch, planned.num_examples, planned.streams_epochs) == (
        eager.steps_per_epoch, eager.num_examples, eager.streams_epochs) == (4, 37, True)
    assert real_ids(collect(planned.epoch_stream(1, 2, num_epochs=2), strategy)) == real_ids(
        collect(eager.epoch_stream(1, 2, num_epochs=2), strategy))
    dataset = planned.distribute()
    assert planned.distribute() is dataset  # built once
    assert dataset.streams_epochs and dataset.pipeline_info == eager.pipeline_info
    assert real_ids(collect(dataset, strategy)) == real_ids(collect(eager, strategy))
