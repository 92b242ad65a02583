"""One worker of the 2-process synchronized BatchNormalization test.

Run by `tests/training/test_sync_batchnorm.py` through `tfdp-launch
--nproc_per_node 2`: each worker trains the model of `sync_bn_model` (BN with
`synchronized=True`) on the shared global batches, once with `model.fit`
through `tfdp.compile` and once with `tfdp.Trainer`, and writes its weights
(moving mean and variance included) to `rank{N}.npz` in the directory given
as the first argument. The test compares them with one device on the same
global batches. Also imported by the test for the model and the data.
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

FEATURES, CLASSES = 4, 3
GLOBAL_BATCH = 16
STEPS = 3
LEARNING_RATE = 0.1


def arrays():
    """Features whose first and second half of each global batch differ in mean and scale,
    so per-replica statistics differ from the global batch's."""
    rng = np.random.default_rng(3)
    n = GLOBAL_BATCH * STEPS
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    second_half = (np.arange(n) % GLOBAL_BATCH) >= GLOBAL_BATCH // 2
    x[second_half] = 3.0 * x[second_half] + 2.0
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def global_batches(order=None):
    """The global batches; `order` permutes the examples within each batch."""
    import tensorflow as tf

    x, y = arrays()
    if order is not None:
        index = np.concatenate([b * GLOBAL_BATCH + np.asarray(order) for b in range(STEPS)])
        x, y = x[index], y[index]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)


def sync_bn_model(synchronized):
    import keras

    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(6, name="dense"),
        keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5, name="bn"),
        keras.layers.ReLU(),
        keras.layers.Dense(CLASSES, name="logits"),
    ])


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer():
    import keras

    return keras.optimizers.SGD(LEARNING_RATE, momentum=0.5)


def main(out_dir):
    import tfdp

    strategy = tfdp.make_strategy("multi_worker")
    rank = int(os.environ["TFDP_RANK"])
    record = {}
    with strategy.scope():
        model = sync_bn_model(True)
        tfdp.compile(model, optimizer=optimizer(), loss=loss())
    model.fit(global_batches(), epochs=1, verbose=0)
    record.update({f"fit_weight{i}": w.numpy() for i, w in enumerate(model.weights)})

    with strategy.scope():
        model = sync_bn_model(True)
        opt = optimizer()
    batch = tfdp.BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync)
    trainer = tfdp.Trainer(model, optimizer=opt, loss=loss(), strategy=strategy, batch=batch)
    trainer.train(global_batches(), epochs=1)
    record.update({f"trainer_weight{i}": w.numpy() for i, w in enumerate(model.weights)})

    # accum_steps=2: the statistics of each global micro-batch.
    with strategy.scope():
        model = sync_bn_model(True)
        tfdp.compile(model, optimizer=optimizer(), loss=loss(), accum_steps=2)
    model.fit(global_batches(), epochs=1, verbose=0)
    record.update({f"accum_weight{i}": w.numpy() for i, w in enumerate(model.weights)})
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)


if __name__ == "__main__":
    main(sys.argv[1])
