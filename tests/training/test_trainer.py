"""Tests for tfdp.Trainer: equivalence with Keras fit, exact resume, evaluation.

Also what Trainer relies on around the loop: the chief's start-up log lines,
non-chief workers' scratch checkpoints (`tfdp.training.checkpointing`), and one
all-reduce per optimizer step with accumulation.
"""

import dataclasses
import glob
import logging
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from strategy_testing import counting_mirrored_strategy
from tfdp.training import checkpointing
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.training.batch import BatchConfig
from tfdp.training.trainer import Trainer

FEATURES, CLASSES = 6, 3
GLOBAL_BATCH = 16
NUM_EXAMPLES = 96  # 6 steps per epoch


def _arrays(n=NUM_EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def _build(strategy, regularized=False):
    with strategy.scope():
        keras.utils.set_random_seed(11)
        reg = keras.regularizers.L2(0.01) if regularized else None
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(8, activation="tanh", kernel_regularizer=reg),
                keras.layers.Dense(CLASSES),
            ]
        )
    return model


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _trainer(strategy, *, accum_steps=1, model_dir=None, steps_per_loop=1, optimizer=None,
             regularized=False, global_batch=GLOBAL_BATCH, **kwargs):
    model = _build(strategy, regularized)
    batch = BatchConfig.from_global(global_batch, strategy.num_replicas_in_sync, accum_steps)
    with strategy.scope():
        optimizer = optimizer or keras.optimizers.SGD(0.5, momentum=0.5)
    return Trainer(
        model,
        optimizer=optimizer,
        loss=_loss(),
        strategy=strategy,
        batch=batch,
        metrics=["accuracy"],
        model_dir=model_dir,
        steps_per_loop=steps_per_loop,
        **kwargs,
    )


def _keras_reference(epochs=1, regularized=False):
    x, y = _arrays()
    model = _build(tf.distribute.get_strategy(), regularized)
    model.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.5), loss=_loss())
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def _global_batches(global_batch=GLOBAL_BATCH):
    return tf.data.Dataset.from_tensor_slices(_arrays()).batch(global_batch, drop_remainder=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas, accum_steps, steps_per_loop, regularized",
    [(1, 1, 1, False), (2, 1, 3, False), (2, 2, 2, True), (4, 1, 6, False)],
)
def test_trainer_matches_keras_fit_on_one_device(replicas, accum_steps, steps_per_loop, regularized):
    reference = _keras_reference(epochs=2, regularized=regularized)
    strategy = (
        tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1 else tfdp.make_strategy("default")
    )
    trainer = _trainer(strategy, accum_steps=accum_steps, steps_per_loop=steps_per_loop,
                       regularized=regularized)
    result = trainer.train(_global_batches(), epochs=2)
    assert result["steps"] == trainer.global_step == 2 * NUM_EXAMPLES // GLOBAL_BATCH
    assert result["epochs"] == 2
    for want, got in zip(reference, trainer.model.weights):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=0)
    assert 0 <= result["accuracy"] <= 1 and np.isfinite(result["loss"])


EPOCHS_COUNTED = 3


class SeenCounter(keras.layers.Layer):
    """Identity on features; in training, counts how often each example id was used.

    The counts are a model weight (summed over replicas on read), so they are
    checkpointed and restored with the model like everything else.
    """

    def __init__(self, size, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def build(self, input_shape):
        # Replicas count into their own copies; reading sums them.
        self.counts = keras.Variable(
            initializer="zeros", shape=(self.size,), trainable=False, name="counts",
            aggregation="sum", synchronization="on_read",
        )

    def call(self, inputs, training=False):
        features, ids = inputs
        if training:
            self.counts.assign_add(tf.reduce_sum(tf.one_hot(ids, self.size), axis=0))
        return features


def _learning_rate(kind):
    """A constant 0.5, or 4 warmup steps to 0.5 then cosine to 0 at step 24."""
    if kind == "constant":
        return 0.5
    return tfdp.WarmupSchedule(0.5, warmup_steps=4, decay="cosine", total_steps=24)


def _counting_trainer(strategy, model_dir, learning_rate=0.5, **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(11)
        features = keras.Input((FEATURES,), name="features")
        ids = keras.Input((), dtype="int32", name="id")
        hidden = SeenCounter(EPOCHS_COUNTED * NUM_EXAMPLES)([features, ids])
        hidden = keras.layers.Dense(8, activation="tanh")(hidden)
        model = keras.Model({"features": features, "id": ids}, keras.layers.Dense(CLASSES)(hidden))
        optimizer = keras.optimizers.SGD(learning_rate, momentum=0.5)
    batch = BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync)
    return Trainer(model, optimizer=optimizer, loss=_loss(), strategy=strategy, batch=batch,
                   model_dir=model_dir, **kwargs)


def _epoch_order(epoch):
    return list(
        tf.data.Dataset.range(NUM_EXAMPLES)
        .shuffle(NUM_EXAMPLES, seed=100 + epoch, reshuffle_each_iteration=False)
        .as_numpy_iterator()
    )


def _dataset_for_epoch(epoch):
    """A per-epoch order that depends only on (seed, epoch); ids count epochs apart."""
    x, y = _arrays()
    order = np.array(_epoch_order(epoch))
    return tf.data.Dataset.from_tensor_slices(
        ({"features": x[order], "id": (epoch * NUM_EXAMPLES + order).astype("int32")}, y[order])
    ).batch(GLOBAL_BATCH, drop_remainder=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas, learning_rate", [(1, "constant"), (2, "constant"), (2, "warmup_cosine")]
)
def test_resume_mid_epoch_matches_an_uninterrupted_run(tmp_path, replicas, learning_rate):
    def strategy():
        return (
            tfdp.make_strategy(cpu_replicas=replicas) if replicas > 1
            else tfdp.make_strategy("default")
        )

    def trainer(name, **kwargs):
        return _counting_trainer(strategy(), str(tmp_path / name),
                                 _learning_rate(learning_rate), **kwargs)

    total = 16  # two epochs of 6 steps, then 4 steps of the third
    straight = trainer("straight")
    straight.train(_dataset_for_epoch, steps=total)

    first = trainer("resumed", checkpoint_every=3)
    first.train(_dataset_for_epoch, steps=9)  # stops mid-way through epoch 1 (and the cosine)
    assert first.global_step == 9
    second = trainer("resumed", checkpoint_every=3)
    assert second.global_step == 0  # a fresh model: nothing restored yet
    second.train(_dataset_for_epoch, steps=total)
    assert second.global_step == total
    # The schedule position is the restored optimizer step.
    schedule = _learning_rate(learning_rate)
    want_lr = schedule if learning_rate == "constant" else float(schedule(total))
    for trainer_ in (straight, second):
        lr = float(keras.ops.convert_to_numpy(trainer_.optimizer.learning_rate))
        assert lr == pytest.approx(want_lr, abs=1e-7)

    for want, got in zip(straight.model.weights, second.model.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)
    for want, got in zip(straight.optimizer.variables, second.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)

    # Exactly the first `total` global batches of the per-epoch orders, each once.
    expected = np.zeros(EPOCHS_COUNTED * NUM_EXAMPLES)
    consumed = [e * NUM_EXAMPLES + i for e in range(EPOCHS_COUNTED) for i in _epoch_order(e)]
    expected[consumed[: total * GLOBAL_BATCH]] = 1
    for trainer in (straight, second):
        counter = next(l for l in trainer.model.layers if isinstance(l, SeenCounter))
        counts = counter.counts.numpy()
        np.testing.assert_array_equal(counts, expected)


def test_checkpoints_and_summaries_on_disk(tmp_path):
    trainer = _trainer(tfdp.make_strategy("default"), model_dir=str(tmp_path), checkpoint_every=4)
    trainer.train(_global_batches(), steps=10)
    index_files = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "ckpt-*.index")))
    assert index_files == ["ckpt-10.index", "ckpt-4.index", "ckpt-8.index"]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-10")
    events = glob.glob(str(tmp_path / "train" / "events.out.tfevents.*"))
    assert len(events) == 1
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(events[0]):
        tags.update(value.tag for value in event.summary.value)
    assert {"loss", "accuracy", "learning_rate", "examples_per_second", "batch/global"} <= tags


def _tfdp_log_messages(caplog):
    """What tfdp (not TensorFlow) logged through absl."""
    package = os.path.dirname(tfdp.__file__) + os.sep
    return [r.getMessage() for r in caplog.records
            if r.name == "absl" and r.pathname.startswith(package)]


def _as_non_chief(monkeypatch, strategy):
    """Makes Trainer see `strategy` as worker 1 of 2, which is not the chief."""
    info = dataclasses.replace(strategy_info_lib.strategy_info(strategy), num_workers=2,
                               worker_index=1, is_chief=False)
    monkeypatch.setattr(strategy_info_lib, "strategy_info", lambda strategy=None: info)


@pytest.mark.slow
def test_chief_logs_the_strategy_and_the_batch_at_start(caplog):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    trainer = _trainer(strategy, accum_steps=2)
    with caplog.at_level(logging.INFO, logger="absl"):
        trainer.train(_global_batches(), steps=1)
    start = [m for m in _tfdp_log_messages(caplog) if m.startswith("tfdp trainer: ")]
    strategy_line = "tfdp trainer: " + tfdp.strategy_info(strategy).describe()
    assert start[:2] == [
        strategy_line,
        "tfdp trainer: batch: 4 per replica × 2 replica(s) × 2 accumulation step(s) = "
        "16 global examples per optimizer step",
    ]
    assert "MirroredStrategy" in strategy_line and "2 replica(s) in sync" in strategy_line


@pytest.mark.slow
def test_non_chief_logs_nothing_and_leaves_no_files(tmp_path, monkeypatch, caplog):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    _as_non_chief(monkeypatch, strategy)
    scratch = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tempfile, "mkdtemp",
                        lambda *a, **k: scratch.append(mkdtemp(*a, **k)) or scratch[-1])
    model_dir = tmp_path / "model_dir"
    trainer = _trainer(strategy, model_dir=str(model_dir), checkpoint_every=2)
    with caplog.at_level(logging.INFO, logger="absl"):
        trainer.train(_global_batches(), steps=5)
    assert trainer.global_step == 5
    assert _tfdp_log_messages(caplog) == []
    assert not model_dir.exists() or list(model_dir.iterdir()) == []
    # It still saved (a save can join a collective) at steps 2, 4 and 5, each
    # into a scratch directory it removed.
    assert len(scratch) == 3
    assert [p for p in scratch if os.path.exists(p)] == []


class _RecordingCheckpoint(tf.train.Checkpoint):
    """Records what each `write` left in its directory; fails if `fail`."""

    def __init__(self, fail=False, **kwargs):
        super().__init__(**kwargs)
        self._fail = fail
        self.writes = []

    def write(self, file_prefix, options=None):
        path = super().write(file_prefix, options=options)
        self.writes.append((path, sorted(os.listdir(os.path.dirname(path)))))
        if self._fail:
            raise OSError("disk full")
        return path


@pytest.mark.parametrize("fail", [False, True])
def test_non_chief_checkpoint_goes_to_a_scratch_directory_that_is_removed(
    tmp_path, monkeypatch, fail
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    checkpoint = _RecordingCheckpoint(fail=fail, v=tf.Variable([1.0, 2.0]))
    model_dir = tmp_path / "model_dir"
    manager = checkpointing.ChiefCheckpointManager(checkpoint, str(model_dir), is_chief=False)
    if fail:
        with pytest.raises(OSError, match="disk full"):
            manager.save(3)
    else:
        assert manager.save(3) is None
    [(path, files)] = checkpoint.writes
    # The checkpoint was written in full, under the temporary directory ...
    assert path.startswith(str(tmp_path / "tmp" / "tfdp-worker-checkpoint-"))
    assert os.path.basename(path) == "ckpt-3"
    assert "ckpt-3.index" in files
    # ... which is gone afterwards, and nothing went to the chief's directory.
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not model_dir.exists()
    assert manager.latest_checkpoint is None


def test_chief_checkpoint_goes_to_model_dir(tmp_path):
    variable = tf.Variable([1.0, 2.0])
    model_dir = tmp_path / "model_dir"
    manager = checkpointing.ChiefCheckpointManager(
        tf.train.Checkpoint(v=variable), str(model_dir), is_chief=True)
    path = manager.save(3)
    assert path == str(model_dir / "ckpt-3") == manager.latest_checkpoint
    variable.assign([0.0, 0.0])
    assert manager.restore_latest() == path
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "accum_steps, global_batch",
    [(4, GLOBAL_BATCH), (1, GLOBAL_BATCH // 4)],  # the second: one step per micro-batch
)
def test_one_gradient_all_reduce_per_optimizer_step(accum_steps, global_batch):
    strategy, counter = counting_mirrored_strategy()
    trainer = _trainer(strategy, accum_steps=accum_steps, global_batch=global_batch,
                       steps_per_loop=3)
    trainer.train(_global_batches(global_batch), epochs=1)
    steps = NUM_EXAMPLES // global_batch
    assert trainer.global_step == steps
    # Counted at run time, once per all-reduce: 6 with accumulation, and 24
    # when every micro-batch is an optimizer step of its own (static batches,
    # no mask: the loss's global counts need no all-reduce).
    assert int(counter.numpy()) == steps
    if global_batch == GLOBAL_BATCH:
        for want, got in zip(_keras_reference(epochs=1), trainer.model.weights):
            np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_steps_are_not_converted_by_autograph_as_in_keras_fit(monkeypatch):
    """A converted function runs from AutoGraph's generated copy, not from its own file."""
    import inspect

    from tfdp.training import train_step as train_step_lib

    files = []
    train_step, eval_step = train_step_lib.replica_train_step, train_step_lib.replica_eval_step

    def recording_train_step(**kwargs):
        files.append(inspect.currentframe().f_code.co_filename)
        return train_step(**kwargs)

    def recording_eval_step(**kwargs):
        files.append(inspect.currentframe().f_code.co_filename)
        return eval_step(**kwargs)

    monkeypatch.setattr(train_step_lib, "replica_train_step", recording_train_step)
    monkeypatch.setattr(train_step_lib, "replica_eval_step", recording_eval_step)
    trainer = _trainer(tfdp.make_strategy(cpu_replicas=2), steps_per_loop=2)
    trainer.train(_global_batches(), steps=2)
    trainer.evaluate(_global_batches())
    assert len(files) >= 2  # traced: train and eval, on each replica
    assert set(files) == {__file__}, files


def test_evaluate_with_a_partial_last_batch_equals_one_device():
    x, y = _arrays(n=50)
    strategy = tfdp.make_strategy(cpu_replicas=2)
    trainer = _trainer(strategy)
    # Reference: one device, every example once.
    reference = keras.metrics.SparseCategoricalAccuracy()
    logits = trainer.model(x, training=False)
    reference.update_state(y, logits)
    reference_loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True)))
    # 50 examples: 3 global batches of 16 and one of 2 (a replica's share of 1).
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    result = trainer.evaluate(dataset)
    assert result["accuracy"] == pytest.approx(float(reference.result()), abs=1e-7)
    assert result["loss"] == pytest.approx(reference_loss, rel=1e-6)


def test_evaluate_counts_zero_weight_padding_as_one_device_does():
    """Padding weighted 0 still counts in the default reduction's divisor, as on one device."""
    x, y = _arrays(n=50)
    strategy = tfdp.make_strategy(cpu_replicas=2)
    trainer = _trainer(strategy)
    pad = 64 - 50
    xp = np.concatenate([x, np.zeros((pad, FEATURES), "float32")])
    yp = np.concatenate([y, np.zeros((pad,), "int32")])
    wp = np.concatenate([np.ones(50, "float32"), np.zeros(pad, "float32")])
    dataset = tf.data.Dataset.from_tensor_slices((xp, yp, wp)).batch(GLOBAL_BATCH)
    one_device = _build(tf.distribute.get_strategy())
    one_device.set_weights(trainer.model.get_weights())
    one_device.compile(loss=_loss(), weighted_metrics=["accuracy"])
    expected = one_device.evaluate(dataset, verbose=0, return_dict=True)
    result = trainer.evaluate(dataset)
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert result["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-7)


def test_argument_errors(tmp_path):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    model = _build(strategy)
    with pytest.raises(ValueError, match=r"must equal the strategy's replicas in sync \(2\)"):
        Trainer(model, optimizer=keras.optimizers.SGD(), loss="mse", strategy=strategy,
                batch=BatchConfig(8, 4))
    with pytest.raises(TypeError, match="tfdp.BatchConfig"):
        Trainer(model, optimizer=keras.optimizers.SGD(), loss="mse", strategy=strategy, batch=16)
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer instance"):
        Trainer(model, optimizer="sgd", loss="mse", strategy=strategy, batch=BatchConfig(8, 2))
    with pytest.raises(ValueError, match="`steps_per_loop` must be a positive integer"):
        Trainer(model, optimizer=keras.optimizers.SGD(), loss="mse", strategy=strategy,
                batch=BatchConfig(8, 2), steps_per_loop=0)
    outside = _build(tf.distribute.get_strategy())
    with pytest.raises(ValueError, match="built outside `strategy.scope\\(\\)`"):
        Trainer(outside, optimizer=keras.optimizers.SGD(), loss="mse", strategy=strategy,
                batch=BatchConfig(8, 2))
    with pytest.raises(ValueError, match="`optimizer` was created outside"):
        Trainer(model, optimizer=keras.optimizers.SGD(), loss="mse", strategy=strategy,
                batch=BatchConfig(8, 2))
    with strategy.scope():
        optimizer = keras.optimizers.SGD()
    trainer = Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                      batch=BatchConfig(8, 2))
    with pytest.raises(ValueError, match="exactly one of `steps`"):
        trainer.train(_global_batches(), steps=2, epochs=1)
    with pytest.raises(ValueError, match="Pass steps_per_epoch"):
        trainer.train(_global_batches().repeat(), epochs=1)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains_without_nans(policy):
    keras.config.set_dtype_policy(policy)
    try:
        strategy = tfdp.make_strategy(cpu_replicas=2)
        trainer = _trainer(strategy, accum_steps=2)
        if policy == "mixed_float16":
            assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
        result = trainer.train(_global_batches(), epochs=2)
        assert np.isfinite(result["loss"])
        assert all(np.isfinite(w.numpy()).all() for w in trainer.model.weights)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.slow
def test_jit_compiled_trainer_matches_keras_fit():
    reference = _keras_reference(epochs=1)
    trainer = _trainer(tfdp.make_strategy("default"), accum_steps=2, jit_compile=True)
    trainer.train(_global_batches(), epochs=1)
    for want, got in zip(reference, trainer.model.weights):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=0)


def test_jit_compile_on_several_cpu_replicas_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="XLA cannot reach variables on another logical CPU"):
        _trainer(tfdp.make_strategy(cpu_replicas=2), jit_compile=True)


@pytest.mark.slow
def test_a_dataset_batched_per_replica_is_refused_before_any_step(tmp_path):
    strategy = tfdp.make_strategy(cpu_replicas=2)
    trainer = _trainer(strategy, model_dir=str(tmp_path))
    before = [w.numpy() for w in trainer.model.weights]
    replica_batch = GLOBAL_BATCH // 2
    per_replica = tf.data.Dataset.from_tensor_slices(_arrays())
    for dataset in (per_replica.batch(replica_batch, drop_remainder=True),  # static shape
                    per_replica.batch(replica_batch)):  # read from the first batch
        with pytest.raises(ValueError, match=rf"first batch holds {replica_batch} examples.*"
                           rf"global batches of {GLOBAL_BATCH}.*batched per replica.*"
                           rf"\.batch\({GLOBAL_BATCH}, drop_remainder=True\)"):
            trainer.train(dataset, epochs=1)
    # A distributed dataset holds per-replica batches: the global batch there is refused.
    wrong = strategy.experimental_distribute_dataset(_global_batches(2 * GLOBAL_BATCH))
    with pytest.raises(ValueError, match=rf"per-replica batches of {replica_batch}"):
        trainer.train(wrong, epochs=1)
    assert int(trainer.optimizer.iterations.numpy()) == 0
    for want, got in zip(before, trainer.model.weights):
        np.testing.assert_array_equal(got.numpy(), want)
    assert not tf.io.gfile.glob(str(tmp_path / "ckpt-*"))
    # The right batches train.
    assert trainer.train(strategy.experimental_distribute_dataset(_global_batches()),
                         steps=1)["steps"] == 1
