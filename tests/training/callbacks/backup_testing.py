"""Data, model and recorders shared by the BackupAndRestore tests and their worker job.

One source of truth for the in-process tests and the two-worker job
(`backup_multiworker_job.py` imports this module too): a seeded tiny
classifier, and a dataset whose order depends only on the epoch and whose
examples carry their id in the last input column. `IdRecorder`, the model's
first layer, records the ids of every batch the model *trains on* (inside the
train step, so prefetched-but-unused batches do not count), which is how the
tests check that each example is seen exactly once per epoch.
"""

from __future__ import annotations

import collections

import numpy as np

FEATURES, CLASSES = 4, 3
NUM_EXAMPLES = 48
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = NUM_EXAMPLES // GLOBAL_BATCH  # 6
EPOCHS = 3
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 18


def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(NUM_EXAMPLES,)).astype("int32")
    ids = np.arange(NUM_EXAMPLES, dtype="float32")[:, None]
    return np.concatenate([x, ids], axis=1), y


def epoch_order(epoch: int) -> np.ndarray:
    """The example ids of `epoch`, in the order they are batched."""
    return np.random.default_rng(100 + epoch).permutation(NUM_EXAMPLES)


def dataset_for_epoch(epoch: int, batch_size: int = GLOBAL_BATCH):
    """Global batches of `epoch`: a seeded order that depends only on `epoch`."""
    import tensorflow as tf

    x, y = arrays()
    order = epoch_order(epoch)
    return tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        batch_size, drop_remainder=True
    )


class Recorder:
    """Collects (epoch, example id) for every example a train step used.

    `epoch_callback(recorder)` keeps `epoch` current and, after every batch,
    records the batch index Keras reported and how many ids had been seen by
    that optimizer step (`seen_until`).
    """

    def __init__(self):
        self.epoch = None
        self.seen = []
        self.batches = []  # (epoch, batch index passed to on_train_batch_end)
        self._seen_by_step = {0: 0}

    def record(self, ids):
        for i in ids.numpy().astype(int).tolist():
            self.seen.append((self.epoch, i))

    def mark(self, step: int) -> None:
        self._seen_by_step[step] = len(self.seen)

    def seen_until(self, step: int) -> list:
        """The (epoch, id) pairs trained on by the end of optimizer step `step`."""
        return self.seen[: self._seen_by_step[step]]


def counts(seen) -> dict:
    """epoch -> Counter(example id -> times trained on) of (epoch, id) pairs."""
    result = collections.defaultdict(collections.Counter)
    for epoch, i in seen:
        result[int(epoch)][int(i)] += 1
    return dict(result)


def build_model(recorder: Recorder | None = None, seed: int = 11):
    import keras
    import tensorflow as tf

    class IdRecorder(keras.layers.Layer):
        """Drops the id column; records the ids when training."""

        def call(self, inputs, training=None):
            if training and recorder is not None:
                tf.py_function(recorder.record, [inputs[:, -1]], [])
            return inputs[:, :-1]

        def compute_output_shape(self, input_shape):
            return (*input_shape[:-1], input_shape[-1] - 1)

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES + 1,)),
            IdRecorder(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )


def compile_model(model, *, accum_steps=1, steps_per_execution=1):
    import keras

    import tfdp

    return tfdp.compile(
        model,
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        accum_steps=accum_steps,
        steps_per_execution=steps_per_execution,
    )


def epoch_callback(recorder: Recorder):
    """A callback that keeps `recorder` told of the epoch, batches and steps."""
    import keras

    class _Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            recorder.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            recorder.batches.append((recorder.epoch, batch))
            recorder.mark(int(self.model.optimizer.iterations.numpy()))

    return _Epochs()


def reference_weights(strategy, *, accum_steps=1, steps_per_execution=1, epochs=EPOCHS):
    """Weights after `epochs` uninterrupted epochs, with plain Keras fit per epoch."""
    with strategy.scope():
        model = build_model()
        compile_model(model, accum_steps=accum_steps, steps_per_execution=steps_per_execution)
    for epoch in range(epochs):
        model.fit(dataset_for_epoch(epoch), epochs=1, verbose=0, shuffle=False)
    return model.get_weights(), int(model.optimizer.iterations.numpy())
