"""The chief of the parameter-server tests: trains digits with tfdp.Trainer, prints `RESULT {json}`.

Run with TF_CONFIG naming the chief (`ps_cluster.LocalPsCluster`). Flags:
--model_dir, --epochs, --steps_per_loop, --checkpoint_every, --steps (total
steps instead of epochs), --mark (a file written when the chief schedules its
second round: the kill test kills a worker then), --dump (an .npz of the
weights and optimizer variables right after restoring, and at the end).
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from tfdp.pipelines import digits  # noqa: E402

GLOBAL_BATCH = 32


def _digits():
    images, labels = digits.load_arrays()
    x = (images.reshape(len(images), 64) / 16.0).astype("float32")
    y = labels.astype("int32")
    split = digits.split_indices()
    return (x[split["train"]], y[split["train"]]), (x[split["test"]], y[split["test"]])


def _values(variables) -> dict:
    return {f"{i}:{getattr(v, 'path', v.name)}": keras.ops.convert_to_numpy(v)
            for i, v in enumerate(variables)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--steps_per_loop", type=int, default=4)
    parser.add_argument("--checkpoint_every", type=int, default=None)
    parser.add_argument("--mark", default=None)
    parser.add_argument("--dump", default=None)
    args = parser.parse_args()

    strategy = tfdp.make_strategy(kind="parameter_server")
    (x_train, y_train), (x_test, y_test) = _digits()
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train)).batch(GLOBAL_BATCH, drop_remainder=True))
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(120)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(0.003)
    trainer = tfdp.Trainer(
        model, optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], strategy=strategy, batch=tfdp.BatchConfig(GLOBAL_BATCH, 1),
        model_dir=args.model_dir, steps_per_loop=args.steps_per_loop,
        checkpoint_every=args.checkpoint_every)

    rounds = []

    def begin():
        rounds.append(trainer.global_step)
        if len(rounds) == 2 and args.mark:
            with open(args.mark + ".tmp", "w") as f:
                f.write(str(trainer.global_step))
            os.replace(args.mark + ".tmp", args.mark)

    trainer.train_loop_begin = begin
    restored = trainer.restore()
    restored_step = trainer.global_step
    if args.dump:
        np.savez(args.dump + "-restored.npz",
                 **_values([*model.weights, *trainer.optimizer.variables]))
    logs = trainer.train(train, epochs=args.epochs, steps=args.steps)
    evaluation = trainer.evaluate(test)
    if args.dump:
        np.savez(args.dump + "-final.npz",
                 **_values([*model.weights, *trainer.optimizer.variables]))
    loop = trainer.parameter_server_loop
    result = {
        "restored": restored, "restored_step": restored_step,
        "logs": logs, "evaluation": evaluation,
        "scheduled_steps": loop.scheduled_steps, "completed_steps": loop.completed_steps,
        "extra_steps": loop.extra_steps,
        "iterations": int(optimizer.iterations.numpy()),
        "global_step": trainer.global_step, "rounds": rounds,
        "info": trainer.info.describe(),
        "model_devices": sorted({w.value.device for w in model.weights}),
        "optimizer_devices": sorted({getattr(v, "value", v).device
                                     for v in trainer.optimizer.variables}),
        "optimizer_variables": [getattr(v, "path", v.name)
                                for v in trainer.optimizer.variables],
    }
    print("RESULT " + json.dumps(result), flush=True)
    # The coordinator's threads keep the interpreter alive at exit; the job is done.
    os._exit(0)


if __name__ == "__main__":
    main()
