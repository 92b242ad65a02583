"""Worker program for the two-worker tfdp.Trainer fault tests, and their shared data.

Run under `tfdp-launch --nproc_per_node 2` as

    python trainer_faults_job.py {train,resume} OUT_DIR

`train`: a `tfdp.Trainer` (MultiWorkerMirroredStrategy, `steps_per_loop=1`,
no `checkpoint_every`: only a SIGTERM saves) on `build_trainer`'s counting
model, writing `OUT_DIR/step-R` (this worker's step) after every step and,
from `PAUSE_AFTER` steps on, sleeping `PAUSE_SECONDS` after each so the test
has time to SIGTERM the launcher. When the Trainer exits the process
(SystemExit), the worker first writes `OUT_DIR/exit-R.json`: the exit code
and its step.

`resume`: trains an uninterrupted reference (no `model_dir`), resumes the
checkpoint in `OUT_DIR/model` with a fresh Trainer, then trains one epoch of
`dataset_for_epoch(0, nan_batch=NAN_BATCH)` (a NaN in one example of one
global batch: worker 1's share) next to a reference that never sees that
batch. Writes `OUT_DIR/rank-R.npz`.

The in-process tests (`test_trainer_faults.py`) import this module for the
data and the model: one source of truth. Each example carries its id; the
model's `SeenCounter` layer counts, per (epoch, id), how often it was trained
on, in a weight summed over replicas on read, so the count is checkpointed
with the model.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

FEATURES, CLASSES = 6, 3
GLOBAL_BATCH = 8
NUM_EXAMPLES = 48
STEPS_PER_EPOCH = NUM_EXAMPLES // GLOBAL_BATCH  # 6
EPOCHS = 3
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 18
PAUSE_AFTER, PAUSE_SECONDS = 6, 1.0
NAN_BATCH = 2
#: Position in the global batch of the example made NaN: the second half,
#: which tf.distribute gives to the second replica (or worker).
NAN_EXAMPLE = GLOBAL_BATCH - 2


def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(NUM_EXAMPLES,)).astype("int32")
    return x, y


def epoch_order(epoch: int) -> np.ndarray:
    """The example ids of `epoch`, in the order they are batched."""
    return np.random.default_rng(100 + epoch).permutation(NUM_EXAMPLES)


def dataset_for_epoch(epoch: int, *, nan_batch: int | None = None, drop_batch: int | None = None,
                      nan_value: float = np.nan):
    """Global batches of `epoch` with example ids; the order depends only on `epoch`.

    Args:
        epoch: the epoch.
        nan_batch: put `nan_value` into one feature of example `NAN_EXAMPLE`
            of this global batch.
        drop_batch: leave this global batch out (a run that never saw it).
        nan_value: what `nan_batch` holds. Defaults to NaN.
    """
    import tensorflow as tf

    x, y = arrays()
    order = epoch_order(epoch)
    x, y = x[order].copy(), y[order]
    ids = (epoch * NUM_EXAMPLES + order).astype("int32")
    if nan_batch is not None:
        x[nan_batch * GLOBAL_BATCH + NAN_EXAMPLE, 0] = nan_value
    keep = np.ones(NUM_EXAMPLES, bool)
    if drop_batch is not None:
        keep[drop_batch * GLOBAL_BATCH:(drop_batch + 1) * GLOBAL_BATCH] = False
    return tf.data.Dataset.from_tensor_slices(
        ({"features": x[keep], "id": ids[keep]}, y[keep])
    ).batch(GLOBAL_BATCH, drop_remainder=True)


def expected_counts(steps: int, epochs: int = EPOCHS) -> np.ndarray:
    """Per (epoch, id) slot: 1 for the examples of the first `steps` global batches."""
    expected = np.zeros(epochs * NUM_EXAMPLES)
    consumed = [e * NUM_EXAMPLES + i for e in range(epochs) for i in epoch_order(e)]
    expected[consumed[: steps * GLOBAL_BATCH]] = 1
    return expected


def build_trainer(strategy, model_dir=None, *, accum_steps=1, seed=11, **kwargs):
    """A Trainer of a small classifier whose first layer counts the examples it trains on."""
    import keras
    import tensorflow as tf

    import tfdp

    size = EPOCHS * NUM_EXAMPLES

    class SeenCounter(keras.layers.Layer):
        def build(self, input_shape):
            # Each replica counts into its own copy; a read sums them.
            self.counts = keras.Variable(
                initializer="zeros", shape=(size,), trainable=False, name="counts",
                aggregation="sum", synchronization="on_read",
            )

        def call(self, inputs, training=False):
            features, ids = inputs
            if training:
                self.counts.assign_add(tf.reduce_sum(tf.one_hot(ids, size), axis=0))
            return features

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        features = keras.Input((FEATURES,), name="features")
        ids = keras.Input((), dtype="int32", name="id")
        hidden = SeenCounter(name="seen_counter")([features, ids])
        hidden = keras.layers.Dense(8, activation="tanh")(hidden)
        model = keras.Model({"features": features, "id": ids}, keras.layers.Dense(CLASSES)(hidden))
        optimizer = keras.optimizers.SGD(0.5, momentum=0.5)
    batch = tfdp.BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync, accum_steps)
    return tfdp.Trainer(
        model, optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy, batch=batch, model_dir=model_dir, **kwargs,
    )


def counts(trainer) -> np.ndarray:
    layer = trainer.model.get_layer("seen_counter")
    return np.asarray(layer.counts.numpy())


def trainable_weights(trainer) -> list:
    return [np.asarray(w.numpy()) for w in trainer.model.trainable_weights]


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def train(out_dir: str, strategy, rank: int) -> None:
    trainer = build_trainer(strategy, os.path.join(out_dir, "model"))

    def report():
        step = int(trainer.optimizer.iterations.numpy())
        _write(os.path.join(out_dir, f"step-{rank}"), str(step))
        if step >= PAUSE_AFTER:
            time.sleep(PAUSE_SECONDS)

    trainer.train_loop_end = report
    try:
        trainer.train(dataset_for_epoch, steps=TOTAL_STEPS)
    except SystemExit as exit_:
        _write(os.path.join(out_dir, f"exit-{rank}.json"),
               json.dumps({"code": exit_.code, "step": trainer.global_step}))
        raise
    _write(os.path.join(out_dir, f"exit-{rank}.json"), json.dumps({"code": 0}))


def resume(out_dir: str, strategy, rank: int) -> None:
    results = {}
    reference = build_trainer(strategy)
    reference.train(dataset_for_epoch, steps=TOTAL_STEPS)
    resumed = build_trainer(strategy, os.path.join(out_dir, "model"), seed=5)
    resumed.train(dataset_for_epoch, steps=TOTAL_STEPS)
    results["steps"] = resumed.global_step
    results["counts"] = counts(resumed)
    for i, (got, want) in enumerate(zip(trainable_weights(resumed), trainable_weights(reference))):
        results[f"weight{i}"] = got
        results[f"reference{i}"] = want

    # A NaN on worker 1's share of one global batch: both workers skip it.
    nan = build_trainer(strategy)
    nan.train(lambda epoch: dataset_for_epoch(epoch, nan_batch=NAN_BATCH), steps=STEPS_PER_EPOCH)
    never_saw = build_trainer(strategy)
    never_saw.train(lambda epoch: dataset_for_epoch(epoch, drop_batch=NAN_BATCH),
                    steps=STEPS_PER_EPOCH - 1)
    results["nan_skipped"] = nan.skipped_steps
    results["nan_iterations"] = int(nan.optimizer.iterations.numpy())
    for i, (got, want) in enumerate(zip(trainable_weights(nan), trainable_weights(never_saw))):
        results[f"nan_weight{i}"] = got
        results[f"nan_reference{i}"] = want
    np.savez(os.path.join(out_dir, f"rank-{rank}.npz"), **results)


def main(mode: str, out_dir: str) -> None:
    import tfdp

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=60)
    rank = tfdp.strategy_info(strategy).worker_index
    {"train": train, "resume": resume}[mode](out_dir, strategy, rank)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1], sys.argv[2])
