"""Worker program for tests/test_multiworker_training.py (two MWMS workers).

Run as `python multiworker_training_job.py OUT_DIR` under
`python -m launch --nproc_per_node 2`. Each worker trains the same tiny model
three ways under `tfdp.make_strategy("multi_worker")` and writes what it ends
with to `OUT_DIR/rank{R}.npz`:

- `fit_*`: `tfdp.compile(accum_steps=2)` + `model.fit`, one epoch;
- `trainer_*`: `tfdp.Trainer(accum_steps=2)`, stopped after `RESUME_AT` steps
  and resumed by a second Trainer from the chief's checkpoint to
  `TOTAL_STEPS`;
- `eval_*`: `Trainer.evaluate` on a zero-weight-padded evaluation set.

The test imports this module too, for the data and model (one source of truth
for the workers and the single-device reference).
"""

from __future__ import annotations

import os
import sys

import numpy as np

FEATURES, CLASSES = 6, 3
GLOBAL_BATCH = 16
NUM_EXAMPLES = 96  # 6 global batches an epoch
RESUME_AT, TOTAL_STEPS = 4, 9
EVAL_EXAMPLES, EVAL_PADDED = 50, 64
ACCUM_STEPS = 2
LEARNING_RATE = 0.5


def arrays(n=NUM_EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")
    return x, y


def global_batches(epoch=0):
    """The training data for `epoch`: a seeded order, global batches."""
    import tensorflow as tf

    x, y = arrays()
    order = np.random.default_rng(100 + epoch).permutation(NUM_EXAMPLES)
    return tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        GLOBAL_BATCH, drop_remainder=True
    )


def padded_eval_batches():
    import tensorflow as tf

    x, y = arrays(EVAL_EXAMPLES, seed=1)
    pad = EVAL_PADDED - EVAL_EXAMPLES
    xp = np.concatenate([x, np.zeros((pad, FEATURES), "float32")])
    yp = np.concatenate([y, np.zeros((pad,), "int32")])
    wp = np.concatenate([np.ones(EVAL_EXAMPLES, "float32"), np.zeros(pad, "float32")])
    return tf.data.Dataset.from_tensor_slices((xp, yp, wp)).batch(GLOBAL_BATCH)


def build_model():
    import keras

    keras.utils.set_random_seed(11)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(CLASSES),
        ]
    )


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer():
    import keras

    return keras.optimizers.SGD(LEARNING_RATE, momentum=0.5)


def _trainer(tfdp, strategy, model_dir):
    with strategy.scope():
        model, opt = build_model(), optimizer()
    batch = tfdp.BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync, ACCUM_STEPS)
    return tfdp.Trainer(model, optimizer=opt, loss=loss(), strategy=strategy, batch=batch,
                        metrics=["accuracy"], model_dir=model_dir, checkpoint_every=2)


def main(out_dir: str) -> None:
    import tfdp

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=60)
    rank = tfdp.strategy_info(strategy).worker_index
    results = {}

    with strategy.scope():
        model = build_model()
        tfdp.compile(model, optimizer=optimizer(), loss=loss(), metrics=["accuracy"],
                     accum_steps=ACCUM_STEPS, steps_per_execution=2)
    history = model.fit(global_batches(), epochs=1, verbose=0)
    results["fit_iterations"] = int(model.optimizer.iterations.numpy())
    results["fit_loss"] = history.history["loss"][-1]
    for i, w in enumerate(model.get_weights()):
        results[f"fit_weight{i}"] = w

    model_dir = os.path.join(out_dir, "model_dir")
    first = _trainer(tfdp, strategy, model_dir)
    first.train(global_batches, steps=RESUME_AT)
    second = _trainer(tfdp, strategy, model_dir)
    summary = second.train(global_batches, steps=TOTAL_STEPS)
    results["trainer_steps"] = summary["steps"]
    for i, w in enumerate(second.model.get_weights()):
        results[f"trainer_weight{i}"] = w
    evaluation = second.evaluate(padded_eval_batches())
    results["eval_loss"] = evaluation["loss"]
    results["eval_accuracy"] = evaluation["accuracy"]
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)


if __name__ == "__main__":
    main(sys.argv[1])
