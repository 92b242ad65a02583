"""ZeRO-1 (`shard_optimizer_state=True`) against unsharded training.

A small MLP whose variables' sizes (35, 7, 7, 1) divide by neither 2 nor 4
is trained on logical CPU replicas through `tfdp.compile` + `fit` and
through `tfdp.Trainer`, once with the optimizer state sharded and once
without; the weights, and the optimizer state gathered from the replicas'
chunks, must agree to 1e-5. Each replica must hold ceil(size / N) elements
of every slot, and the chunks of all replicas must tile the unsharded state.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training.batch import BatchConfig

FEATURES = 5
HIDDEN = 7
GLOBAL_BATCH = 16
STEPS = 6
TOLERANCE = 1e-5

_rng = np.random.default_rng(11)
X = _rng.normal(size=(GLOBAL_BATCH * STEPS, FEATURES)).astype("float32")
Y = (np.tanh(X @ _rng.normal(size=(FEATURES, 1))) + 0.1).astype("float32")
INITIAL = [
    _rng.normal(size=(FEATURES, HIDDEN)).astype("float32") * 0.5,
    _rng.normal(size=(HIDDEN,)).astype("float32") * 0.1,
    _rng.normal(size=(HIDDEN, 1)).astype("float32") * 0.5,
    np.zeros(1, "float32"),
]

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "lars": lambda: tfdp.optimizers.LARS(0.5, momentum=0.9, weight_decay=1e-3, eeta=0.1),
    "lamb": lambda: tfdp.optimizers.LAMB(0.05, weight_decay=0.01),
}


@pytest.fixture(scope="module")
def strategies():
    return {n: tfdp.make_strategy(cpu_replicas=n) for n in (2, 4)}


def dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH, drop_remainder=True)


def mlp():
    model = keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.set_weights(INITIAL)
    return model


def fit(strategy, optimizer, sharded, accum_steps=1, **compile_kwargs):
    with strategy.scope():
        model = mlp()
        tfdp.compile(model, optimizer=OPTIMIZERS[optimizer](), loss="mse",
                     accum_steps=accum_steps, shard_optimizer_state=sharded, **compile_kwargs)
    model.fit(dataset(), epochs=1, verbose=0)
    return model


def replica_values(strategy, variable):
    return [c.numpy() for c in strategy.experimental_local_results(
        getattr(variable, "value", variable))]


def assert_same_state(strategy, sharded_model, plain_model):
    for sharded, plain in zip(sharded_model.get_weights(), plain_model.get_weights()):
        np.testing.assert_allclose(sharded, plain, atol=TOLERANCE, rtol=0)
    # Every replica holds the same full weights after the all-gather.
    for variable in sharded_model.trainable_variables:
        copies = replica_values(strategy, variable)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    sharded_vars = sharded_model.optimizer.inner_optimizer.variables
    plain_vars = plain_model.optimizer.inner_optimizer.variables
    assert len(sharded_vars) == len(plain_vars)
    for sharded, plain in zip(sharded_vars, plain_vars):
        expected = replica_values(strategy, plain)[0]
        copies = replica_values(strategy, sharded)
        if np.ndim(expected) == 0 or strategy.num_replicas_in_sync == 1:
            np.testing.assert_allclose(copies[0], expected, atol=TOLERANCE)
            continue
        size = expected.size
        assert all(c.shape == (math.ceil(size / strategy.num_replicas_in_sync),) for c in copies)
        full = np.concatenate(copies)[:size].reshape(expected.shape)
        np.testing.assert_allclose(full, expected, atol=TOLERANCE, rtol=0)
        # The padding past the variable's end stays zero.
        np.testing.assert_array_equal(np.concatenate(copies)[size:], 0)


@pytest.mark.slow
@pytest.mark.parametrize("replicas, optimizer", [
    (2, "sgd_momentum"), (2, "adam"), (2, "adamw"), (2, "lars"), (4, "lamb"),
])
def test_fit_equals_unsharded_training(strategies, replicas, optimizer):
    strategy = strategies[replicas]
    sharded = fit(strategy, optimizer, True)
    plain = fit(strategy, optimizer, False)
    assert sharded.optimizer.iterations.numpy() == STEPS
    assert_same_state(strategy, sharded, plain)


@pytest.mark.slow
@pytest.mark.parametrize("option", [
    lambda: {"accum_steps": 2},
    lambda: {"gradient_compression": tfdp.compression.PowerSGD(rank=1, min_compression_ratio=1)},
    lambda: {"nonfinite": "raise"},
], ids=["accumulation", "powersgd", "raise"])
def test_composes_with_accumulation_compression_and_the_guard(strategies, option):
    strategy = strategies[2]
    sharded = fit(strategy, "adam", True, **option())
    plain = fit(strategy, "adam", False, **option())
    assert_same_state(strategy, sharded, plain)


@pytest.mark.slow
def test_mixed_precision_equals_unsharded_training(strategies):
    strategy = strategies[2]
    keras.config.set_dtype_policy("mixed_float16")
    try:
        sharded = fit(strategy, "adam", True)
        plain = fit(strategy, "adam", False)
    finally:
        keras.config.set_dtype_policy("float32")
    assert type(sharded.optimizer).__name__ == "NonFiniteLossScaleOptimizer"
    assert_same_state(strategy, sharded, plain)


def train(strategy, sharded, model_dir=None, steps=STEPS, optimizer="adam"):
    with strategy.scope():
        model = mlp()
        optimizer = OPTIMIZERS[optimizer]()
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                           batch=BatchConfig.from_global(GLOBAL_BATCH,
                                                         strategy.num_replicas_in_sync),
                           model_dir=model_dir,
                           checkpoint_every=3, shard_optimizer_state=sharded)
    trainer.train(dataset(), steps=steps)
    model.optimizer = trainer.optimizer
    return model


@pytest.mark.slow
def test_trainer_equals_unsharded_training_and_resumes_exactly(strategies, tmp_path):
    """Stopped at step 3 and resumed, the sharded run ends as the unsharded one."""
    strategy = strategies[2]
    train(strategy, True, model_dir=str(tmp_path / "run"), steps=3)
    # Each replica's chunks of the slots are saved beside the checkpoint.
    assert (tmp_path / "run" / "replica_state" / "ckpt-3" / "worker-0-of-1.npz").exists()
    resumed = train(strategy, True, model_dir=str(tmp_path / "run"))
    assert int(resumed.optimizer.iterations.numpy()) == STEPS
    plain = train(strategy, False)
    assert_same_state(strategy, resumed, plain)


@pytest.mark.slow
def test_each_replica_holds_its_share(strategies):
    strategy = strategies[4]
    model = fit(strategy, "adam", True)
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]  # 35, 7, 7, 1
    sharding = model.optimizer.sharding
    assert sharding.active and sharding.num_shards == 4
    assert sharding.shard_elements == sum(math.ceil(s / 4) for s in sizes)
    slots = [v for v in model.optimizer.inner_optimizer.variables if v.shape.rank]
    assert len(slots) == 2 * len(sizes)  # Adam's m and v
    per_replica = sum(int(np.prod(v.shape)) for v in slots)
    assert per_replica == 2 * sum(math.ceil(s / 4) for s in sizes)
    # Over all replicas the chunks cover the unsharded state, plus padding only.
    assert 4 * per_replica - 2 * sum(sizes) == 2 * sum(4 * math.ceil(s / 4) - s for s in sizes)


@pytest.mark.parametrize("make, message", [
    (lambda: keras.optimizers.Lamb(0.01), "Lamb"),
    (lambda: tfdp.optimizers.LAMB(0.01, clipvalue=0.1), "clipvalue"),
    (lambda: keras.optimizers.Adam(0.01, clipnorm=1.0), "clipnorm"),
    (lambda: keras.optimizers.Adam(0.01, global_clipnorm=1.0), "global_clipnorm"),
    (lambda: keras.optimizers.Adam(0.01, use_ema=True), "use_ema"),
])
def test_optimizers_that_need_whole_variables_are_refused(strategies, make, message):
    with strategies[2].scope():
        model = mlp()
        with pytest.raises(ValueError, match=message):
            tfdp.compile(model, optimizer=make(), loss="mse", shard_optimizer_state=True)


def test_refused_with_local_steps_and_without_the_wrapper(strategies):
    with strategies[2].scope():
        model = mlp()
        with pytest.raises(ValueError, match="local steps"):
            tfdp.compile(model, optimizer="sgd", loss="mse", sync_every=2,
                         shard_optimizer_state=True)
        with pytest.raises(ValueError, match="nonfinite='skip'"):
            tfdp.compile(model, optimizer="sgd", loss="mse", nonfinite=None,
                         shard_optimizer_state=True)


def test_one_replica_shards_nothing():
    model = mlp()
    tfdp.compile(model, optimizer=keras.optimizers.Adam(0.01), loss="mse",
                 shard_optimizer_state=True)
    model.fit(dataset(), epochs=1, verbose=0)
    assert not model.optimizer.sharding.active
    slots = [tuple(v.shape) for v in model.optimizer.inner_optimizer.variables if v.shape.rank]
    assert sorted(slots) == sorted(2 * [tuple(v.shape) for v in model.trainable_variables])


def test_config_round_trip():
    optimizer = nonfinite_lib.wrap_optimizer(keras.optimizers.Adam(0.01), nonfinite="skip",
                                             shard_optimizer_state=True)
    again = type(optimizer).from_config(optimizer.get_config())
    assert again.shards_optimizer_state


@pytest.mark.slow
@pytest.mark.parametrize("before, after, optimizer", [
    (4, 2, "adam"), (2, 1, "adam"), (1, 2, "adam"), (2, 4, "lamb"),
])
def test_resume_on_another_replica_count_repartitions_the_state(
        strategies, tmp_path, before, after, optimizer):
    """Stopped at step 3 on `before` replicas, resumed on `after`: as uninterrupted training."""
    model_dir = str(tmp_path / "run")
    strategy = lambda n: strategies.get(n) or tfdp.make_strategy(cpu_replicas=n)  # noqa: E731
    train(strategy(before), True, model_dir=model_dir, steps=3, optimizer=optimizer)
    resumed = train(strategy(after), True, model_dir=model_dir, optimizer=optimizer)
    assert int(resumed.optimizer.iterations.numpy()) == STEPS
    plain = train(strategy(after), False, optimizer=optimizer)
    assert_same_state(strategy(after), resumed, plain)


@pytest.mark.slow
def test_resume_with_error_memories_on_another_replica_count_is_refused(strategies, tmp_path):
    """Error-feedback memories cannot be split: refused before anything changes."""
    model_dir = tmp_path / "run"

    def trainer(strategy):
        with strategy.scope():
            model = mlp()
            optimizer = keras.optimizers.Adam(0.01)
        return model, tfdp.Trainer(
            model, optimizer=optimizer, loss="mse", strategy=strategy,
            batch=BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync),
            model_dir=str(model_dir), checkpoint_every=3, shard_optimizer_state=True,
            gradient_compression=tfdp.compression.TopK(fraction=0.5))

    trainer(strategies[2])[1].train(dataset(), steps=3)

    def checkpoint_files():  # TensorBoard event files aside
        return sorted(p.relative_to(model_dir) for p in model_dir.rglob("*")
                      if "tfevents" not in p.name)

    before = checkpoint_files()
    model, resumed = trainer(strategies[4])
    with pytest.raises(ValueError, match=r"2 replica\(s\) per worker.*this run has 4"):
        resumed.train(dataset(), steps=STEPS)
    assert checkpoint_files() == before
    np.testing.assert_array_equal(model.get_weights()[0], INITIAL[0])


@pytest.mark.slow
def test_weights_gathered_in_several_buckets_equal_one(strategies, monkeypatch):
    """With a 32-byte bound every variable is gathered on its own: the same result."""
    from tfdp.distribute import optimizer_sharding

    monkeypatch.setattr(optimizer_sharding, "GATHER_BUCKET_BYTES", 32)
    strategy = strategies[2]
    sharded = fit(strategy, "adam", True)
    assert len(sharded.optimizer.sharding._buckets()) == 4
    plain = fit(strategy, "adam", False)
    assert_same_state(strategy, sharded, plain)


@pytest.mark.slow
def test_gradients_reach_the_chunks_by_all_to_all_and_are_never_all_reduced(strategies,
                                                                            monkeypatch):
    """Each replica sends its chunks for replica j to j and sums what it receives.

    The only all-reduce left in a step is the one-float non-finite verdict;
    the gradients cross the wire once, as ``[N, sum S]`` (sizes 35, 7, 7, 1
    on 2 replicas: chunks of 18, 4, 4 and 1).
    """
    from tfdp._upstream import collective_exchange
    from tfdp.distribute import reduction

    sent, reduced = [], []
    real_all_to_all, real_all_reduce = collective_exchange.all_to_all, reduction.all_reduce_sum

    def recording_all_to_all(context, tensor):
        sent.append(tuple(tensor.shape))
        return real_all_to_all(context, tensor)

    def recording_all_reduce(context, tensors, *args, **kwargs):
        reduced.append(sum(int(np.prod(t.shape)) for t in tensors if t is not None))
        return real_all_reduce(context, tensors, *args, **kwargs)

    monkeypatch.setattr(collective_exchange, "all_to_all", recording_all_to_all)
    monkeypatch.setattr(reduction, "all_reduce_sum", recording_all_reduce)
    strategy = strategies[2]
    sharded = fit(strategy, "adam", True)
    assert sharded.optimizer.sharding.scatters
    # Traced once per replica (MirroredStrategy traces each replica's step).
    assert sent and set(sent) == {(2, 18 + 4 + 4 + 1)}
    assert reduced and set(reduced) == {1}
    # With bfloat16 sums the gradients are all-reduced (in bfloat16) and sliced.
    sent.clear()
    fit(strategy, "adam", True, all_reduce_dtype="bfloat16")
    assert sent == []


@pytest.mark.slow
@pytest.mark.parametrize("load_on", [4, 1])
def test_keras_file_holds_the_unsharded_state_and_loads_on_any_replica_count(
        strategies, tmp_path, load_on):
    """`model.save()` gathers the chunks; `load_model` cuts them for its own replicas."""
    sharded = fit(strategies[2], "adam", True)
    plain = fit(strategies[2], "adam", False)
    path = str(tmp_path / "model.keras")
    sharded.save(path)
    strategy = strategies.get(load_on) or tfdp.make_strategy(cpu_replicas=load_on)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.shards_optimizer_state
    assert loaded.optimizer.sharding.num_shards == load_on
    assert_same_state(strategy, loaded, plain)


@pytest.mark.slow
def test_another_optimizers_state_on_another_replica_count_is_refused_unchanged(
        strategies, tmp_path):
    model_dir = str(tmp_path / "run")
    train(strategies[2], True, model_dir=model_dir, steps=3, optimizer="adam")
    with strategies[4].scope():
        model = mlp()
        optimizer = OPTIMIZERS["sgd_momentum"]()
    trainer = tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategies[4],
                           batch=BatchConfig.from_global(GLOBAL_BATCH, 4), model_dir=model_dir,
                           checkpoint_every=3, shard_optimizer_state=True)
    with pytest.raises(ValueError, match="has 10 variables.*SGD has 6.*Nothing was changed"):
        trainer.train(dataset(), steps=STEPS)
    np.testing.assert_array_equal(model.get_weights()[0], INITIAL[0])


# On one host with several GPUs. No GPU here: the strategies below are stand-ins,
# MirroredStrategies over device names that are never run on; what is tested is
# the choice of exchange, not NCCL's reduce-scatter itself.
@pytest.mark.parametrize("cross_device_ops", [tf.distribute.NcclAllReduce, lambda: None],
                         ids=["NcclAllReduce", "collective"])
def test_on_gpus_zero1_reduce_scatters_over_nccl_whatever_the_all_reduce(cross_device_ops):
    """MirroredStrategy builds NCCL collective launchers beside any all-reduce it is given
    (tfdp.make_strategy's NcclAllReduce included): ZeRO-1 takes NCCL's reduce-scatter."""
    from tfdp._upstream import collective_exchange
    from tfdp.distribute import shard_layout

    stand_in = tf.distribute.MirroredStrategy(["/gpu:0", "/gpu:1"],
                                              cross_device_ops=cross_device_ops())
    assert collective_exchange.exchange_kind(stand_in) == "reduce_scatter"
    shard_layout.check_strategy(stand_in)  # not refused


def test_replicas_without_a_reduce_scatter_are_refused_not_all_reduced():
    """Devices of two kinds: MirroredStrategy falls back to ReductionToOneDevice, no launchers."""
    from tfdp.distribute import shard_layout

    stand_in = tf.distribute.MirroredStrategy(["/gpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True cannot reduce-scatter "
                       r"the gradients among the 2 replicas.*GPU:0.*CPU:0.*Use tfdp.make_strategy"):
        shard_layout.check_strategy(stand_in)


@pytest.mark.parametrize("entry", ["compile", "trainer"])
def test_without_launchers_zero1_is_refused_before_anything_runs(strategies, monkeypatch, entry):
    """TensorFlow outside the launchers' known range (simulated): refused, naming it, where
    main trained silently with an all-reduce and slice; a compressed exchange still shards."""
    from tfdp._upstream import collective_exchange

    monkeypatch.setattr(collective_exchange, "is_supported", lambda *a: False)
    strategy = strategies[2]

    def build(**kwargs):
        with strategy.scope():
            model = mlp()
            optimizer = OPTIMIZERS["adam"]()
            if entry == "compile":
                tfdp.compile(model, optimizer=optimizer, loss="mse", shard_optimizer_state=True,
                             **kwargs)
                return model
        return tfdp.Trainer(model, optimizer=optimizer, loss="mse", strategy=strategy,
                            batch=BatchConfig.from_global(GLOBAL_BATCH, 2),
                            shard_optimizer_state=True, **kwargs)

    with pytest.raises(ValueError, match=r"cannot reduce-scatter.*TensorFlow .* is outside"):
        build()
    build(gradient_compression="bfloat16")  # all-reduces and slices by design
