"""Activation recomputation (`remat=True`): same outputs, same gradients, state moved once.

Each rematerialisable model is built twice from the same seed, with and
without `remat`, and one training forward and backward pass runs on both under
a 2-replica CPU `MirroredStrategy` inside a `tf.function` (as `fit` and
`Trainer` run it): the per-replica gradients, the logits and the
non-trainable state after the step (BatchNormalization moving statistics,
Dropout seed generators) agree to 1e-6 (relative to the gradient's size).
The CIFAR ResNets run at depth 8 (their builder, one block per stage);
ResNet-50, whose blocks are cut out of `keras.applications.ResNet50` by the
same `rematerialize_blocks`, runs one eager step on one device (2 replicas
in a `tf.function` would take a minute to trace).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import models
from tfdp.models import remat as remat_lib
from tfdp.models import resnet_cifar

CLASSES = 3
PER_REPLICA = 2

#: Each model at a tiny size: (input_shape, extra keyword arguments). Dropout
#: is on, so the recomputation must draw the forward pass's masks.
TINY = {
    "transformer": ((6,), dict(vocab_size=50, num_layers=2, num_heads=2, hidden=8,
                               dropout=0.3)),
    "resnet8": ((8, 8, 3), {}),  # resnet20's builder at depth 8: one block per stage
}
RESNET50_INPUT = (32, 32, 3)


@pytest.fixture(scope="module")
def strategy():
    return tfdp.make_strategy(cpu_replicas=2)


def _build(strategy, key, remat):
    input_shape, kwargs = TINY[key]
    with strategy.scope():
        keras.utils.set_random_seed(7)
        if key == "resnet8":
            return resnet_cifar.resnet_cifar(depth=8, input_shape=input_shape,
                                             num_classes=CLASSES, remat=remat)
        return models.get(key.removesuffix("_post_ln"), input_shape=input_shape,
                          num_classes=CLASSES, remat=remat, **kwargs)


def _data(key, replicas):
    input_shape = TINY[key][0]
    rng = np.random.default_rng(0)
    n = PER_REPLICA * replicas
    if key.startswith("transformer"):
        x = rng.integers(1, 50, size=(n, *input_shape)).astype("int32")
        x[:, -2:] = 0  # padding: the mask must reach every block
    else:
        x = rng.normal(size=(n, *input_shape)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(n,)).astype("int32")


def _key(variable):
    return "/".join(variable.path.split("/")[-2:])


def _train_step(strategy, model, x, y):
    """Per-replica logits and gradients of one training step, and the state after it."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def step(batch):
        def replica_fn(features, labels):
            with tf.GradientTape() as tape:
                logits = model(features, training=True)
                loss = loss_fn(labels, logits)
            grads = tape.gradient(loss, model.trainable_variables)
            return logits, [tf.convert_to_tensor(g) for g in grads]  # embeddings: dense

        return strategy.run(replica_fn, args=batch)

    logits, grads = step(batch)
    local = strategy.experimental_local_results
    # Keyed by the variable's own layer and name: under remat the layers sit
    # inside the blocks, in the same order.
    grads = {_key(v): [g.numpy() for g in local(grad)]
             for v, grad in zip(model.trainable_variables, grads)}
    state = [(v.name, v.numpy()) for v in model.non_trainable_variables]
    return [t.numpy() for t in local(logits)], grads, state


def _assert_same_step(plain, remat):
    (plain_logits, plain_grads, plain_state), (logits, grads, state) = plain, remat
    for want, got in zip(plain_logits, logits):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert sorted(grads) == sorted(plain_grads)
    for path, want in plain_grads.items():
        for w, g in zip(want, grads[path]):
            scale = max(1.0, float(np.abs(w).max()))
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale, err_msg=path)
    # Moving statistics and seed generator states, in the same order.
    assert [n for n, _ in state] == [n for n, _ in plain_state]
    for (name, got), (_, want) in zip(state, plain_state):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)


def _rematerialized(model):
    return [layer for layer in _layers(model) if isinstance(layer, remat_lib.Rematerialized)]


def _layers(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _layers(layer)


@pytest.mark.slow
@pytest.mark.parametrize("key, blocks", [("transformer", 2), ("resnet8", 3)])
def test_remat_gives_the_gradients_and_state_of_no_remat(strategy, key, blocks):
    x, y = _data(key, strategy.num_replicas_in_sync)
    plain = _train_step(strategy, _build(strategy, key, remat=False), x, y)
    remat_model = _build(strategy, key, remat=True)
    assert len(_rematerialized(remat_model)) == blocks
    _assert_same_step(plain, _train_step(strategy, remat_model, x, y))


def _eager_step(model, x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = loss_fn(y, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    return ([logits.numpy()],
            {_key(v): [g.numpy()] for v, g in zip(model.trainable_variables, grads)},
            [(v.name, v.numpy()) for v in model.non_trainable_variables])


@pytest.mark.slow
def test_resnet50_remat_recomputes_its_16_blocks_with_the_same_gradients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, *RESNET50_INPUT)).astype("float32")
    y = np.array([0, 2], dtype="int32")
    results = []
    for remat in (False, True):
        keras.utils.set_random_seed(7)
        model = models.get("resnet50", input_shape=RESNET50_INPUT, num_classes=CLASSES,
                           remat=remat)
        assert len(_rematerialized(model)) == (16 if remat else 0)
        results.append(_eager_step(model, x, y))
    _assert_same_step(*results)


def test_rematerialize_blocks_names_the_unknown_layer():
    model = resnet_cifar.resnet_cifar(depth=8, input_shape=(8, 8, 3), num_classes=CLASSES)
    with pytest.raises(ValueError, match="no layer.*stage9_block1_out"):
        remat_lib.rematerialize_blocks(model, start="stem_relu", ends=["stage9_block1_out"])
    with pytest.raises(ValueError, match="at least one block"):
        remat_lib.rematerialize_blocks(model, start="stem_relu", ends=[])


def test_a_remat_model_saves_and_loads_with_its_blocks(tmp_path):
    model = _build(tf.distribute.get_strategy(), "transformer", remat=True)
    x, _ = _data("transformer", 1)
    model.save(tmp_path / "remat.keras")
    loaded = keras.models.load_model(tmp_path / "remat.keras")
    assert len(_rematerialized(loaded)) == 2
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=0, atol=1e-6)
