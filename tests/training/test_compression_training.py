"""Training through `gradient_compression`: `tfdp.compile` + fit and `tfdp.Trainer` on 2 replicas.

A compressor that keeps everything (PowerSGD at full rank with compression
forced on, Top-K with fraction 1) must train exactly as the plain all-reduce;
a real compression must still lower the loss; `start_step` must all-reduce
uncompressed until then; the errors name the argument.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training.batch import BatchConfig

GLOBAL_BATCH = 16
STEPS = 4


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(3),
    ])


def dataset():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 3, GLOBAL_BATCH * STEPS)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit(strategy, gradient_compression, epochs=1):
    with strategy.scope():
        m = model()
        tfdp.compile(m, optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss(),
                     gradient_compression=gradient_compression)
    history = m.fit(dataset(), epochs=epochs, verbose=0)
    return m, history.history["loss"]


def train(strategy, gradient_compression):
    with strategy.scope():
        m = model()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    trainer = tfdp.Trainer(m, optimizer=optimizer, loss=loss(), strategy=strategy,
                           batch=BatchConfig.from_global(GLOBAL_BATCH, 2),
                           gradient_compression=gradient_compression)
    trainer.train(dataset(), steps=STEPS)
    return m


def assert_same_weights(a, b, tolerance=1e-5):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, rtol=tolerance, atol=tolerance)


_plain = {}


def plain(strategy, path):
    if path not in _plain:
        _plain[path] = fit(strategy, None)[0] if path == "fit" else train(strategy, None)
    return _plain[path]


LOSSLESS = {
    "powersgd_full_rank": lambda: tfdp.compression.PowerSGD(rank=64, min_compression_ratio=0.01),
    "topk_everything": lambda: tfdp.compression.TopK(fraction=1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fit", "trainer"])
@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_a_compressor_that_keeps_everything_trains_as_the_plain_all_reduce(name, path, two_replicas):
    compressed = (fit(two_replicas, LOSSLESS[name]())[0] if path == "fit"
                  else train(two_replicas, LOSSLESS[name]()))
    assert_same_weights(compressed, plain(two_replicas, path))


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [
    lambda: tfdp.compression.PowerSGD(rank=1),
    lambda: tfdp.compression.TopK(fraction=0.05),
])
def test_real_compression_still_trains(compressor, two_replicas):
    m, losses = fit(two_replicas, compressor(), epochs=8)
    assert losses[-1] < 0.8 * losses[0]
    assert not np.allclose(m.get_weights()[0], plain(two_replicas, "fit").get_weights()[0])


@pytest.mark.slow
def test_before_start_step_the_gradients_are_all_reduced_uncompressed(two_replicas):
    m, _ = fit(two_replicas, tfdp.compression.PowerSGD(rank=1, start_step=STEPS))
    assert_same_weights(m, plain(two_replicas, "fit"))
    memories = m.optimizer.compressor.state
    assert not any(np.any(np.array(v.values[0])) for v in memories[:1])


def test_bfloat16_is_the_all_reduce_dtype(two_replicas):
    with two_replicas.scope():
        m = model()
        tfdp.compile(m, optimizer="sgd", loss=loss(), gradient_compression="bfloat16")
    assert m.optimizer.all_reduce_dtype == "bfloat16" and m.optimizer.compressor is None


@pytest.mark.parametrize("kwargs, message", [
    ({"gradient_compression": "powersgd"}, "`gradient_compression` must be None"),
    ({"gradient_compression": tfdp.compression.TopK(0.1), "nonfinite": None},
     r"nonfinite=None cannot be combined with gradient_compression=TopK\(fraction=0.1\)"),
    ({"gradient_compression": "bfloat16", "all_reduce_dtype": "float16"}, "all_reduce_dtype"),
])
def test_bad_combinations_are_refused_naming_the_argument(kwargs, message, two_replicas):
    with two_replicas.scope():
        m = model()
    with pytest.raises(ValueError, match=message):
        tfdp.compile(m, optimizer="sgd", loss=loss(), **kwargs)


@pytest.mark.slow
def test_under_mixed_float16_the_memories_hold_unscaled_gradients(two_replicas):
    """The loss scale is divided out before compression: lossless PowerSGD equals no compression."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        results = []
        for compressor in (None, LOSSLESS["powersgd_full_rank"]()):
            m, losses = fit(two_replicas, compressor)
            results.append(m)
            assert np.isfinite(losses[-1])
        assert int(results[1].optimizer.iterations.numpy()) == STEPS
        assert_same_weights(results[1], results[0], tolerance=1e-3)
        scale = float(results[1].optimizer.dynamic_scale.numpy())
        memory = np.abs(np.array(results[1].optimizer.compressor.state[0].values[0])).max()
        assert memory < 1.0 < scale  # not multiplied by the loss scale
    finally:
        keras.config.set_dtype_policy("float32")


def test_the_compressor_survives_the_optimizer_config(two_replicas):
    with two_replicas.scope():
        m = model()
        tfdp.compile(m, optimizer="sgd", loss=loss(),
                     gradient_compression=tfdp.compression.PowerSGD(rank=3, start_step=7))
        config = keras.optimizers.serialize(m.optimizer)
        again = keras.optimizers.deserialize(config)
    assert repr(again.compressor) == repr(m.optimizer.compressor)
    assert "rank=3, start_step=7" in repr(again.compressor)


class _WithSpare(keras.layers.Layer):
    """A Dense layer with a trainable weight its output does not use (no gradient)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")
        self.spare = self.add_weight(shape=(6, 5), name="spare")

    def call(self, x):
        return tf.matmul(x, self.kernel)


@pytest.mark.parametrize("compressor", [
    lambda: tfdp.compression.PowerSGD(rank=1, min_compression_ratio=0.01),
    lambda: tfdp.compression.TopK(fraction=0.5),
    lambda: "float8",
], ids=["PowerSGD", "TopK", "float8"])
def test_a_variable_without_a_gradient_keeps_its_compressor_state(two_replicas, compressor):
    """Its error memory (and PowerSGD's Q) stay as they were: nothing is sent for it.

    The memory is set non-zero first, as an earlier phase of training (before
    the layer was frozen, say) would leave it.
    """
    with two_replicas.scope():
        keras.utils.set_random_seed(5)
        spare = _WithSpare()
        m = keras.Sequential([keras.Input((8,)), spare, keras.layers.Dense(1)])
        tfdp.compile(m, optimizer=keras.optimizers.SGD(0.1), loss="mse",
                     gradient_compression=compressor())
        m.optimizer.build(m.trainable_variables)
    compressor = m.optimizer.compressor
    index = [i for i, v in enumerate(m.trainable_variables) if v is spare.spare][0]
    sizes = [int(np.prod(v.shape)) for v in m.trainable_variables]
    start = sum(sizes[:index])
    if isinstance(compressor, tfdp.compression.TopK):  # one flat memory
        memory, cut = compressor.state[0], slice(start, start + sizes[index])
    else:  # per variable, in build order (PowerSGD: every variable here is compressed)
        memory, cut = compressor.state[index], slice(None)
    value = memory.numpy()
    value.reshape(-1)[cut] = np.linspace(-2.0, 2.0, sizes[index])
    memory.assign(value)
    before = [[np.array(c) for c in two_replicas.experimental_local_results(v)]
              for v in compressor.state]
    x = np.random.default_rng(1).normal(size=(GLOBAL_BATCH * 2, 8)).astype("float32")
    m.fit(x, x[:, :1], batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    after = [[np.array(c) for c in two_replicas.experimental_local_results(v)]
             for v in compressor.state]
    kept = [index, 3 + index] if isinstance(compressor, tfdp.compression.PowerSGD) else [
        0 if isinstance(compressor, tfdp.compression.TopK) else index]
    for k in kept:
        for old, new in zip(before[k], after[k]):
            np.testing.assert_array_equal(new.reshape(-1)[cut], old.reshape(-1)[cut])
    assert any(not np.array_equal(a, b) for a, b in zip(before[-1], after[-1])), \
        "the other variables' state did not move"


def _keras_model_checkpoint(path):
    return keras.callbacks.ModelCheckpoint(str(path / "model.keras"))


def _keras_backup_and_restore(path):
    return keras.callbacks.BackupAndRestore(str(path / "backup"), delete_checkpoint=False)


@pytest.mark.parametrize("make_saver,name", [
    (_keras_model_checkpoint, "keras.callbacks.ModelCheckpoint"),
    (_keras_backup_and_restore, "keras.callbacks.BackupAndRestore"),
    (None, "model.save()"),
], ids=["ModelCheckpoint", "BackupAndRestore", "model.save"])
def test_keras_savers_warn_that_they_lose_the_error_memories(two_replicas, tmp_path, caplog,
                                                             make_saver, name):
    """Issue 33, finding 6: they keep no error memory; the warning names the saver and the fix.

    The memories are not optimizer variables: neither a `.keras` file nor
    Keras' backups hold them (tfdp's checkpoints write every replica's copy).
    """
    with two_replicas.scope():
        trained = model()
        tfdp.compile(trained, optimizer=keras.optimizers.SGD(0.1), loss=loss(),
                     gradient_compression=tfdp.compression.TopK(fraction=0.3))
    callbacks = [] if make_saver is None else [make_saver(tmp_path)]
    with caplog.at_level("WARNING"):
        trained.fit(dataset(), epochs=1, verbose=0, callbacks=callbacks)
        if make_saver is None:
            trained.save(str(tmp_path / "model.keras"))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    named = [w for w in warnings if name in w and "error-feedback memories" in w]
    assert named, warnings
    assert "tfdp.callbacks.BackupAndRestore" in named[0]
    memories = trained.optimizer.compressor.state
    saved = {v.path for v in trained.optimizer.variables}
    assert not any(getattr(v, "path", v.name) in saved for v in memories)
