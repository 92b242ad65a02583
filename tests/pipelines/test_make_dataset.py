"""Tests for `tfdp.pipelines.distributed_dataset` and `tfdp.pipelines.input_pipeline`: exactly once, equal steps."""

import collections
import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import pipelines
from pipeline_testing import collect, get_strategy, id_dataset, real_ids
from tfdp.pipelines import input_pipeline as pipeline_lib

# "multiworker_local2": one input pipeline feeding two replicas, as on a
# MultiWorkerMirroredStrategy worker with two GPUs.
STRATEGY_NAMES = ["default", "one_device", "mirrored2", "mirrored4", "multiworker_local2"]


def _cardinality(dataset) -> int:
    """What Keras takes as the steps per epoch (`TFDatasetAdapter.num_batches`)."""
    cardinality = dataset.cardinality
    return int(cardinality() if callable(cardinality) else cardinality)


@pytest.mark.parametrize("strategy_name", STRATEGY_NAMES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_one_epoch_visits_every_example_exactly_once(strategy_name, training):
    strategy = get_strategy(strategy_name)
    num_examples, global_batch = 37, 8  # 37 is not a multiple of any global batch.
    dataset = pipelines.make_dataset(
        id_dataset(num_examples), strategy=strategy, global_batch=global_batch,
        training=training, seed=3,
    )
    info = dataset.pipeline_info
    steps = collect(dataset, strategy)

    assert len(steps) == info.steps_per_epoch == dataset.steps_per_epoch == _cardinality(dataset)
    per_replica = global_batch // strategy.num_replicas_in_sync
    sizes = [[len(parts[0]) for parts in step] for step in steps]
    assert all(len(step) == strategy.num_replicas_in_sync for step in sizes)
    ids = real_ids(steps)
    assert len(ids) == len(set(ids)), "an example was seen twice"
    if training:
        assert info.steps_per_epoch == num_examples // global_batch
        assert all(size == per_replica for step in sizes for size in step)
        assert len(ids) == info.steps_per_epoch * global_batch
        # Only the final partial global batch is lost, and it is counted.
        assert info.dropped_per_epoch == num_examples - len(ids) == 5
    else:
        assert sorted(ids) == list(range(num_examples))
        assert info.steps_per_epoch == 5 and info.dropped_per_epoch == 0
        assert all(size <= per_replica for step in sizes for size in step)
        short = sum(size < per_replica for step in sizes for size in step)
        assert short == info.partial_batches_per_epoch > 0


@pytest.mark.parametrize(
    "num_pipelines,num_replicas", [(2, 2), (3, 3), (2, 4)],
    ids=["2pipelines", "3pipelines", "2pipelines-2replicas-each"],
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_uneven_split_gives_every_pipeline_the_same_step_count(
    num_pipelines, num_replicas, training
):
    # Workers of a MultiWorkerMirroredStrategy are simulated by calling the
    # dataset function with each worker's input context, as TF does.
    num_examples, global_batch = 47, 12  # 47 splits unevenly 2 and 3 ways.
    pipeline = pipeline_lib.InputPipeline(
        source=pipelines.get_source(id_dataset(num_examples)), split="train",
        batch=tfdp.BatchConfig.from_global(global_batch, num_replicas), training=training,
        shuffle=True,
        seed=0, shard_policy="auto", drop_remainder=training, cache=False,
        preprocess=None,
    )
    contexts = [
        tf.distribute.InputContext(num_pipelines, i, num_replicas)
        for i in range(num_pipelines)
    ]
    batches = [list(pipeline(context)) for context in contexts]

    _, info = pipeline.plan(num_pipelines, num_replicas)
    replicas_per_pipeline = num_replicas // num_pipelines
    expected = info.steps_per_epoch * replicas_per_pipeline
    assert [len(b) for b in batches] == [expected] * num_pipelines
    ids = []
    for pipeline_batches in batches:
        for features, _ in pipeline_batches:
            assert len(features) <= global_batch // num_replicas
            if training:
                assert len(features) == global_batch // num_replicas
            ids.extend(int(i) for i in features)
    assert len(ids) == len(set(ids))
    if training:
        assert num_examples - global_batch < len(ids) <= num_examples
        assert info.dropped_per_epoch == num_examples - len(ids)
    else:
        assert sorted(ids) == list(range(num_examples))


def test_digits_file_sharding_reads_every_example_once(digits_dir):
    source = pipelines.get_source("digits", data_dir=digits_dir)
    pipeline = pipeline_lib.InputPipeline(
        source=source, split="test", batch=tfdp.BatchConfig.from_global(40, 2), training=False,
        shuffle=False, seed=None, shard_policy="auto", drop_remainder=False,
        cache=False, preprocess=None,
    )
    seen = collections.Counter()
    counts = []
    for i in range(2):
        batches = list(pipeline(tf.distribute.InputContext(2, i, 2)))
        counts.append(len(batches))
        for images, labels in batches:
            for image, label in zip(images.numpy(), labels.numpy()):
                seen[(image.tobytes(), int(label))] += 1
    _, info = pipeline.plan(2, 2)
    assert info.shard_mode == "file"
    assert counts[0] == counts[1] == info.steps_per_epoch
    everything = collections.Counter(
        (image.tobytes(), int(label)) for image, label in source.read("test").as_numpy_iterator()
    )
    assert seen == everything
    assert sum(everything.values()) == 360


@pytest.mark.slow
def test_training_reshuffles_each_epoch_and_a_seed_makes_it_reproducible():
    strategy = get_strategy("mirrored2")

    def epochs(seed, count):
        dataset = pipelines.make_dataset(
            id_dataset(64), strategy=strategy, global_batch=8, seed=seed
        )
        return [real_ids(collect(dataset, strategy)) for _ in range(count)]

    first, second = epochs(seed=7, count=2)
    assert first != second and sorted(first) == sorted(second)
    assert epochs(seed=7, count=2) == [first, second]
    assert epochs(seed=8, count=1)[0] != first


def test_evaluation_does_not_shuffle():
    strategy = get_strategy("default")
    dataset = pipelines.make_dataset(
        id_dataset(20), strategy=strategy, global_batch=8, training=False
    )
    assert real_ids(collect(dataset, strategy)) == list(range(20))


@pytest.mark.parametrize(
    "replicas,global_batch,accum_steps,nearest",
    [("mirrored2", 5, 1, "4 or 6"), ("mirrored2", 8, 3, "6 or 12"), ("mirrored4", 2, 1, "4")],
)
def test_global_batch_must_divide_by_replicas_times_accum_steps(
    replicas, global_batch, accum_steps, nearest
):
    strategy = get_strategy(replicas)
    with pytest.raises(ValueError) as error:
        pipelines.make_dataset(
            id_dataset(64), strategy=strategy, global_batch=global_batch,
            accum_steps=accum_steps,
        )
    message = str(error.value)
    assert f"global_batch={global_batch}" in message
    unit = strategy.num_replicas_in_sync * accum_steps
    assert f"= {strategy.num_replicas_in_sync} × {accum_steps} = {unit}" in message
    assert f"Nearest valid global batches: {nearest}." in message


def test_accum_steps_info():
    dataset = pipelines.make_dataset(
        id_dataset(64), strategy=get_strategy("mirrored2"), global_batch=24, accum_steps=3
    )
    info = dataset.pipeline_info
    assert (info.per_replica_batch, info.micro_batch, info.accum_steps) == (12, 4, 3)
    assert "3 micro-batches of 4" in info.describe()


def test_a_batch_config_gives_the_same_batches_and_is_kept_as_is():
    # One BatchConfig from the flags to the training code: make_dataset keeps
    # the object it is given, and batches exactly as the global_batch form.
    strategy = get_strategy("mirrored2")
    batch = tfdp.BatchConfig.from_global(24, num_replicas=2, accum_steps=3)
    given = pipelines.make_dataset(id_dataset(64), strategy=strategy, batch=batch, seed=0)
    built = pipelines.make_dataset(id_dataset(64), strategy=strategy, global_batch=24,
                                   accum_steps=3, seed=0)
    assert given.pipeline_info.batch is batch
    assert built.pipeline_info.batch == batch
    given_steps, built_steps = collect(given, strategy), collect(built, strategy)
    assert len(given_steps) == len(built_steps) == 2
    for given_step, built_step in zip(given_steps, built_steps):
        for given_parts, built_parts in zip(given_step, built_step):
            for a, b in zip(given_parts, built_parts):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(), ValueError, r"Pass the batch: `batch=tfdp.BatchConfig\(...\)`.*Received neither"),
    (dict(batch=tfdp.BatchConfig(4, 2), global_batch=8), ValueError,
     r"Pass `batch` alone.*Received also: global_batch=8, accum_steps=None"),
    (dict(batch=tfdp.BatchConfig(4, 2), accum_steps=2), ValueError,
     r"Pass `batch` alone.*accum_steps=2"),
    (dict(batch=8), TypeError, r"`batch` must be a tfdp.BatchConfig \(for a number, pass "
                               r"`global_batch`\)\. Received: batch=8 of type int"),
    (dict(batch=tfdp.BatchConfig(4, 4)), ValueError,
     r"`batch` is for 4 replica\(s\), but the strategy has 2 replica\(s\) in sync\. "
     r"Build it for this strategy, e\.g\. tfdp\.BatchConfig\.from_global\(16, "
     r"num_replicas=strategy\.num_replicas_in_sync, accum_steps=1\)"),
])
def test_the_batch_is_given_once_and_for_this_strategy(kwargs, error, match):
    with pytest.raises(error, match=match):
        pipelines.make_dataset(id_dataset(64), strategy=get_strategy("mirrored2"), **kwargs)


def test_an_input_context_with_other_replicas_than_the_batch_is_refused():
    pipeline = pipeline_lib.InputPipeline(
        source=pipelines.get_source(id_dataset(16)), split="train",
        batch=tfdp.BatchConfig(2, 2), training=True, shuffle=False, seed=0,
        shard_policy="auto", drop_remainder=True, cache=False, preprocess=None,
    )
    with pytest.raises(ValueError, match=r"The input context has 4 replica\(s\) in sync, "
                                         r"but the batch is for 2"):
        pipeline(tf.distribute.InputContext(1, 0, 4))


def test_training_split_smaller_than_one_global_batch_is_an_error():
    with pytest.raises(ValueError, match=r"has 3 examples, fewer than one global batch of 4"):
        pipelines.make_dataset(id_dataset(3), strategy=get_strategy("mirrored2"), global_batch=4)


def test_evaluation_of_a_split_smaller_than_one_global_batch_pads_it():
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(
        id_dataset(3), strategy=strategy, global_batch=4, training=False
    )
    steps = collect(dataset, strategy)
    assert len(steps) == 1 and sorted(real_ids(steps)) == [0, 1, 2]


@pytest.mark.parametrize(
    "dataset,match",
    [
        (tf.data.Dataset.range(8), r"must be a \(features, label\) tuple"),
        (tf.data.Dataset.range(8).map(lambda i: {"x": i, "y": i}), r"\(features, label\) tuple"),
        (
            pipelines.SyntheticTokens(num_examples=8),
            r"static shape to be batched.*pipelines.pad_tokens",
        ),
    ],
    ids=["bare-tensor", "dict", "variable-length"],
)
def test_examples_must_be_features_label_tuples_of_static_shape(dataset, match):
    with pytest.raises(ValueError, match=match):
        pipelines.make_dataset(dataset, strategy=get_strategy("default"), global_batch=4)


def test_preprocess_must_keep_the_features_label_structure():
    with pytest.raises(ValueError, match=r"'preprocess'.*\(features, label\) tuple"):
        pipelines.make_dataset(
            id_dataset(8), strategy=get_strategy("default"), global_batch=4,
            preprocess=lambda x, y: x,
        )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(strategy=None), TypeError, r"`strategy` must be a tf.distribute.Strategy"),
        (dict(global_batch=0), ValueError, r"`global_batch` must be a positive integer"),
        (dict(global_batch=4.0), ValueError, r"Received: global_batch=4.0"),
        (dict(accum_steps=0), ValueError, r"`accum_steps` must be a positive integer"),
        (dict(shard_policy="files"), ValueError, r"`shard_policy` must be one of"),
        (dict(training="yes"), TypeError, r"`training` must be True or False"),
        (dict(seed=-1), ValueError, r"`seed` must be an integer >= 0"),
        (dict(cache=1), TypeError, r"`cache` must be True/False"),
        (dict(preprocess="normalize"), TypeError, r"`preprocess` must be a callable"),
        (dict(split=0), TypeError, r"`split` must be a string"),
        (dict(split="test"), ValueError, r"`split` selects a split of a named source"),
        (dict(data_dir="/tmp"), ValueError, r"`data_dir` only applies to named sources"),
        (
            dict(training=False, drop_remainder=True), ValueError,
            r"Evaluation never drops examples.*Remove `drop_remainder`.*"
            r"Received: training=False, drop_remainder=True",
        ),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    arguments = dict(strategy=get_strategy("default"), global_batch=4)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        pipelines.make_dataset(id_dataset(8), **arguments)


def test_training_without_drop_remainder_keeps_the_partial_batch():
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(
        id_dataset(13), strategy=strategy, global_batch=4, drop_remainder=False, seed=0
    )
    assert dataset.steps_per_epoch == 4 and dataset.pipeline_info.partial_batches_per_epoch == 2
    steps = collect(dataset, strategy)
    assert sorted(real_ids(steps)) == list(range(13))
    assert [len(parts[0]) for parts in steps[-1]] == [1, 0]  # 13 = 3 x 4 + 1


def test_callable_source_that_shards_itself_is_used_as_is():
    calls = []

    def dataset_fn(context):
        calls.append((context.num_input_pipelines, context.input_pipeline_id))
        return id_dataset(30).shard(context.num_input_pipelines, context.input_pipeline_id)

    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(dataset_fn, strategy=strategy, global_batch=4, training=False)
    assert dataset.pipeline_info.shard_mode == "context"
    assert sorted(real_ids(collect(dataset, strategy))) == list(range(30))
    assert (2, 1) in calls


def test_callable_source_that_ignores_its_context_is_sharded_by_element():
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(
        lambda context: id_dataset(30), strategy=strategy, global_batch=4, training=False
    )
    assert dataset.pipeline_info.shard_mode == "data"
    assert sorted(real_ids(collect(dataset, strategy))) == list(range(30))


def test_callable_source_with_overlapping_shards_is_an_error():
    # 30 examples in all, but each of the 2 pipelines gets 20 of them.
    with pytest.raises(ValueError, match=r"neither partition its 30 examples"):
        pipelines.make_dataset(
            lambda context: id_dataset(30 if context.num_input_pipelines == 1 else 20),
            strategy=get_strategy("mirrored2"), global_batch=4,
        )


def test_shard_policy_off_repeats_every_example_on_every_pipeline():
    strategy = get_strategy("mirrored2")
    dataset = pipelines.make_dataset(
        id_dataset(8), strategy=strategy, global_batch=4, training=False, shard_policy="off"
    )
    ids = real_ids(collect(dataset, strategy))
    assert collections.Counter(ids) == {i: 2 for i in range(8)}


@pytest.mark.slow
def test_endless_source_has_no_epoch_and_cannot_be_evaluated():
    strategy = get_strategy("mirrored2")
    endless = id_dataset(10).repeat()
    dataset = pipelines.make_dataset(endless, strategy=strategy, global_batch=4, seed=0)
    assert dataset.steps_per_epoch is None and dataset.num_examples == pipelines.INFINITE
    iterator = iter(dataset)
    for _ in range(6):
        next(iterator)
    with pytest.raises(ValueError, match="Evaluation needs a finite dataset"):
        pipelines.make_dataset(endless, strategy=strategy, global_batch=4, training=False)


def test_random_preprocess_is_reproducible_with_a_seed_and_new_every_epoch():
    strategy = get_strategy("default")
    images = tf.data.Dataset.range(16).map(
        lambda i: (tf.reshape(tf.range(16.0) + tf.cast(i, tf.float32), (4, 4, 1)), i)
    )

    def epochs(seed):
        dataset = pipelines.make_dataset(
            images, strategy=strategy, global_batch=16, seed=seed,
            preprocess=pipelines.random_crop_flip(padding=1), cache=True,
        )
        return [next(iter(dataset))[0].numpy() for _ in range(2)]

    first = epochs(seed=1)
    assert not np.array_equal(first[0], first[1])
    np.testing.assert_array_equal(epochs(seed=1), first)


def test_every_source_example_of_an_epoch_is_cached_then_reused(tmp_path):
    reads = tf.Variable(0, dtype=tf.int64)

    def count(i):
        reads.assign_add(1)
        return i, i

    source = tf.data.Dataset.range(12).map(count)
    strategy = get_strategy("default")
    dataset = pipelines.make_dataset(
        source, strategy=strategy, global_batch=4, seed=0, cache=str(tmp_path / "cache")
    )
    for _ in range(3):
        assert len(collect(dataset, strategy)) == 3
    # Three epochs, but the source was read once, to fill the cache.
    assert int(reads.numpy()) == 12


def _classifier(num_features=3, num_classes=4):
    inputs = keras.Input((num_features,))
    return keras.Model(inputs, keras.layers.Dense(num_classes, activation="softmax")(inputs))


def _features_dataset(num_examples, num_features=3, num_classes=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_examples, num_features)).astype("float32")
    y = rng.integers(0, num_classes, size=num_examples)
    return x, y, tf.data.Dataset.from_tensor_slices((x, y))


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored4", "multiworker_local2"])
def test_evaluation_metrics_equal_single_device_metrics_exactly(strategy_name):
    num_examples = 37
    x, y, source = _features_dataset(num_examples)
    reference_model = _classifier()
    weights = reference_model.get_weights()
    probabilities = reference_model.predict(x, verbose=0)
    expected_accuracy = np.mean(np.argmax(probabilities, axis=1) == y)
    expected_crossentropy = np.mean(-np.log(probabilities[np.arange(num_examples), y]))

    strategy = get_strategy(strategy_name)
    with strategy.scope():
        model = _classifier()
        model.set_weights(weights)
        model.compile(
            loss="sparse_categorical_crossentropy",
            metrics=[
                keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                keras.metrics.SparseCategoricalCrossentropy(name="crossentropy"),
            ],
        )
    # 37 examples over global batches of 8: the last step has 5 examples,
    # spread over the replicas as partial and empty batches.
    dataset = pipelines.make_dataset(source, strategy=strategy, global_batch=8, training=False)
    assert dataset.pipeline_info.partial_batches_per_epoch > 0
    results = model.evaluate(dataset, return_dict=True, verbose=0)
    # Accuracy counts exactly; cross-entropy sums in another order.
    assert results["accuracy"] == np.float32(np.sum(np.argmax(probabilities, 1) == y)) / np.float32(
        num_examples
    )
    assert results["accuracy"] == pytest.approx(expected_accuracy, rel=1e-7)
    assert results["crossentropy"] == pytest.approx(expected_crossentropy, rel=1e-6)
    assert results["loss"] == pytest.approx(expected_crossentropy, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy_name", ["mirrored2", "multiworker_local2"],
    ids=["pipeline-per-replica", "one-pipeline-two-replicas"],
)
def test_fit_runs_every_step_of_every_epoch(strategy_name):
    strategy = get_strategy(strategy_name)
    _, _, source = _features_dataset(40)
    dataset = pipelines.make_dataset(source, strategy=strategy, global_batch=8, seed=0)
    assert dataset.pipeline_info.num_input_pipelines == (
        1 if strategy_name == "multiworker_local2" else 2
    )
    with strategy.scope():
        model = _classifier()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")

    class CountSteps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

        def on_epoch_end(self, epoch, logs=None):
            counts.append((self.params["steps"], self.steps))  # Progress bar's total, run.

    for steps_per_epoch in (None, dataset.steps_per_epoch):
        counts = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(
                dataset, epochs=3, steps_per_epoch=steps_per_epoch,
                callbacks=[CountSteps()], verbose=0,
            )
        assert counts == [(5, 5)] * 3
        assert not [w for w in caught if "ran out of data" in str(w.message)]


def test_dropped_examples_are_a_warning_logged_once_per_dataset(caplog, monkeypatch):
    from tfdp.pipelines import input_pipeline as pipeline_lib

    monkeypatch.setattr(pipeline_lib, "_DROP_WARNINGS_GIVEN", set())
    strategy = get_strategy("mirrored2")  # Two input pipelines, one log.
    with caplog.at_level(logging.INFO, logger="absl"):
        pipelines.make_dataset(id_dataset(37), strategy=strategy, global_batch=8, seed=0)
    records = [r for r in caplog.records if r.getMessage().startswith("pipelines: ")]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING]
    assert "37 examples, global batch 8" in records[0].getMessage()
    assert "drop_remainder drops 5 of 37 examples every epoch" in records[1].getMessage()

    # The next epoch's dataset (a training loop builds one per epoch) does not
    # repeat the warning.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        pipelines.make_dataset(id_dataset(37), strategy=strategy, global_batch=8, seed=1)
    records = [r for r in caplog.records if r.getMessage().startswith("pipelines: ")]
    assert [r.levelno for r in records] == [logging.INFO]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        pipelines.make_dataset(id_dataset(40), strategy=strategy, global_batch=8, seed=0)
        pipelines.make_dataset(id_dataset(37), strategy=strategy, global_batch=8, training=False)
    records = [r for r in caplog.records if r.getMessage().startswith("pipelines: ")]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO]  # Nothing dropped.


def _dataset_ops(dataset: tf.data.Dataset) -> list[tuple[str, list]]:
    """The dataset's chain of transformations, last first, as TensorFlow runs it.

    Follows each op's input dataset from the output back to the source (side
    inputs such as the seed dataset of a random `preprocess` are skipped).

    Returns:
        `[(op, inputs), ...]`: each input's value if it is a numeric constant,
        else `None`.
    """
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(
        tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor).numpy()
    )
    nodes = {node.name: node for node in graph.node}

    def node_of(name):
        return nodes[name.split(":")[0]]

    def constant(name):
        node = node_of(name)
        if node.op != "Const" or not tf.as_dtype(node.attr["dtype"].type).is_numpy_compatible:
            return None
        return tf.make_ndarray(node.attr["value"].tensor)

    chain = []
    node = node_of(next(n for n in graph.node if n.op == "_Retval").input[0])
    while node.op.endswith(("Dataset", "DatasetV2", "DatasetV3")):
        inputs = [name for name in node.input if not name.startswith("^")]
        chain.append((node.op, [constant(name) for name in inputs]))
        if not inputs:
            break
        node = node_of(inputs[0])
    return chain


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("where", ["default-strategy", "worker-of-2-with-2-replicas"])
def test_pipeline_maps_and_batches_in_parallel_and_prefetches_last(where, training):
    arguments = dict(
        source=pipelines.SyntheticImages(num_examples=64, image_shape=(8, 8, 3)),
        global_batch=8, training=training, seed=0,
        preprocess=pipelines.for_images(training=training, augment=training),
    )
    if where == "default-strategy":
        dataset = pipelines.make_dataset(strategy=get_strategy("default"), **arguments)
    else:
        pipeline = pipeline_lib.InputPipeline(
            source=arguments.pop("source"), split="train",
            batch=tfdp.BatchConfig.from_global(arguments.pop("global_batch"), 4), shuffle=True,
            shard_policy="auto", drop_remainder=training, cache=False, **arguments,
        )
        dataset = pipeline(tf.distribute.InputContext(2, 1, 4))
    ops = _dataset_ops(dataset)
    names = [op for op, _ in ops]
    autotune = tf.data.AUTOTUNE
    # Last transformation: prefetch, with an autotuned buffer (OptionsDataset
    # only carries the tf.data options).
    assert names[:2] == ["OptionsDataset", "PrefetchDataset"], names
    assert ops[1][1][1] == autotune
    # A parallel, autotuned batch before it, and a parallel autotuned map
    # (the preprocessing) before that: ParallelBatchDataset(input, batch_size,
    # num_parallel_calls, drop_remainder), ParallelMapDatasetV2(input,
    # captured..., num_parallel_calls).
    batch = names.index("ParallelBatchDataset")
    assert ops[batch][1][2] == autotune
    assert "ParallelMapDatasetV2" in names[batch + 1:], names
    parallel_map = names.index("ParallelMapDatasetV2")
    assert ops[parallel_map][1][-1] == autotune
    assert "MapDataset" not in names[:parallel_map] and "BatchDatasetV2" not in names

