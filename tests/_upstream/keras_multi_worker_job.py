"""One worker of the 2-worker Keras job in `test_keras_multi_worker.py`.

Runs under `tfdp-launch --nproc_per_node 2 -- python THIS_FILE MODE OUT_DIR`
(TF_CONFIG and TFDP_RANK come from the launcher) and writes what the test
checks to `OUT_DIR/rank{R}.json` and `OUT_DIR/rank{R}.npz`:

- MODE `fixed`: `tfdp.make_strategy("multi_worker")` (which applies
  `tfdp._upstream.keras_multi_worker`), then for `steps_per_execution` 1 and 4:
  fit from fixed initial weights (with validation data), evaluate, predict.
- MODE `unfixed`: removes the patches, then adds them back one at a time and
  records how `fit` fails at each stage (the test expects each upstream bug
  to still be there).

The model, data and feed are defined here (`make_data`, `build_model`,
`make_dataset`) so the test builds its single-device reference from the same
code. The feed is plain `model.fit(dataset)` on the *global* dataset, batched
by the global batch, with `AutoShardPolicy.DATA`: TensorFlow splits every
global batch of 16 into one half per worker, in order, so 2 workers x 8
examples see exactly the batches one device sees with 16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import numpy as np

GLOBAL_BATCH = 16
NUM_TRAIN = 96  # 6 global batches per epoch.
EPOCHS = 2
# 45 = 2 x 16 + 13: the last batch is split 7 / 6 between the workers, so
# per-worker example counts differ and metric weighting is exercised.
NUM_EVAL = 45
NUM_FEATURES = 4
NUM_CLASSES = 3
HIDDEN = 8
LEARNING_RATE = 0.1
# 4 does not divide the 6 steps of an epoch: the last execution is partial.
STEPS_PER_EXECUTION = (1, 4)
COLLECTIVE_TIMEOUT_SECONDS = 60.0


def make_data() -> dict[str, np.ndarray | list[np.ndarray]]:
    """Deterministic data and initial weights (NumPy only; same in every process)."""
    rng = np.random.RandomState(0)
    teacher = rng.randn(NUM_FEATURES, NUM_CLASSES)
    x_train = rng.randn(NUM_TRAIN, NUM_FEATURES).astype("float32")
    x_eval = rng.randn(NUM_EVAL, NUM_FEATURES).astype("float32")
    initial_weights = [
        (rng.randn(NUM_FEATURES, HIDDEN) * 0.5).astype("float32"),
        (rng.randn(HIDDEN) * 0.1).astype("float32"),
        (rng.randn(HIDDEN, NUM_CLASSES) * 0.5).astype("float32"),
        (rng.randn(NUM_CLASSES) * 0.1).astype("float32"),
    ]
    return {
        "x_train": x_train,
        "y_train": np.argmax(x_train @ teacher, axis=1).astype("int32"),
        "x_eval": x_eval,
        "y_eval": np.argmax(x_eval @ teacher, axis=1).astype("int32"),
        "initial_weights": initial_weights,
    }


def build_model(initial_weights, *, steps_per_execution: int = 1):
    """A compiled 2-layer classifier with plain SGD (build it under the strategy's scope)."""
    import keras

    model = keras.Sequential(
        [
            keras.Input((NUM_FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.set_weights(initial_weights)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def make_dataset(x, y=None):
    """The global dataset, batched by the global batch, auto-sharded by DATA."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.batch(GLOBAL_BATCH).with_options(options)


def batch_logs_callback():
    import keras

    class BatchLogs(keras.callbacks.Callback):
        """Records the logs of every `on_train_batch_end` call."""

        def __init__(self):
            super().__init__()
            self.logs = []

        def on_train_batch_end(self, batch, logs=None):
            self.logs.append({k: float(v) for k, v in (logs or {}).items()})

    return BatchLogs()


def run_fixed(out_dir: str, rank: int) -> None:
    import tfdp
    from tfdp._upstream import keras_multi_worker

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS)
    data = make_data()
    train = make_dataset(data["x_train"], data["y_train"])
    evaluation = make_dataset(data["x_eval"], data["y_eval"])
    results = {
        "applied": list(keras_multi_worker.applied()),
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "strategy_info": dataclasses.asdict(tfdp.strategy_info(strategy)),
        "runs": {},
    }
    # What this worker's replica receives from the feed fit uses
    # (`experimental_distribute_dataset`, as Keras' TFEpochIterator calls it).
    arrays = {
        "local_train_x": np.concatenate(
            [
                strategy.experimental_local_results(x)[0].numpy()
                for x, _ in strategy.experimental_distribute_dataset(train)
            ]
        )
    }
    for spe in STEPS_PER_EXECUTION:
        with strategy.scope():
            model = build_model(data["initial_weights"], steps_per_execution=spe)
        batch_logs = batch_logs_callback()
        history = model.fit(
            train, epochs=EPOCHS, validation_data=evaluation, callbacks=[batch_logs], verbose=0
        )
        results["runs"][str(spe)] = {
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "batch_logs": batch_logs.logs,
            "evaluate": {
                k: float(v)
                for k, v in model.evaluate(evaluation, return_dict=True, verbose=0).items()
            },
        }
        for i, weight in enumerate(model.get_weights()):
            arrays[f"spe{spe}_weight{i}"] = weight
        arrays[f"spe{spe}_predict"] = model.predict(make_dataset(data["x_eval"]), verbose=0)
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


#: Stages of MODE `unfixed`: (name, patches in place, steps_per_execution).
#: Ordered so each stage's failure is the next bug in the user's path. The
#: last stage fails inside a running collective step, after which a worker's
#: collectives cannot be trusted, so it must stay last.
UNFIXED_STAGES = (
    ("symbolic_build_batch", (), 1),
    ("reduce_logs_mean", ("symbolic_build_batch",), 1),
    ("cond_call_time_captures", ("symbolic_build_batch", "reduce_logs_mean"), 2),
)


def run_unfixed(out_dir: str, rank: int) -> None:
    import tfdp
    from tfdp._upstream import keras_multi_worker

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS)
    keras_multi_worker.remove()
    data = make_data()
    train = make_dataset(data["x_train"], data["y_train"])
    stages = []
    for name, patches, spe in UNFIXED_STAGES:
        keras_multi_worker.remove()
        keras_multi_worker.apply(patches)
        with strategy.scope():
            model = build_model(data["initial_weights"], steps_per_execution=spe)
        try:
            model.fit(train, epochs=1, verbose=0)
        except Exception as error:  # pylint: disable=broad-except
            stages.append(
                {
                    "stage": name,
                    "applied": list(keras_multi_worker.applied()),
                    "outcome": "error",
                    "type": type(error).__name__,
                    "message": str(error)[-20000:],
                }
            )
        else:
            stages.append(
                {"stage": name, "applied": list(keras_multi_worker.applied()), "outcome": "ok"}
            )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"stages": stages}, f)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("fixed", "unfixed"):
        print(f"usage: {argv[0]} fixed|unfixed OUT_DIR", file=sys.stderr)
        return 2
    rank = int(os.environ["TFDP_RANK"])
    try:
        (run_fixed if argv[1] == "fixed" else run_unfixed)(argv[2], rank)
    except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
