"""The README's main job written in plain one-process Keras: the `fixed_costs` baseline.

    python -m tfdp.bench.plain_keras_digits --data_dir=DIR --backup_dir=DIR --out=result.json

What a user would write without tfdp, for the job `tfdp-train --dataset=digits
--model=cnn` runs by default: the registered `cnn` (`tfdp.models`, the only
tfdp code it runs: a Keras model builder) on the TFDS digits train split
(`tfdp.pipelines.digits`' builder, prepared beforehand), uint8 pixels scaled to
[0, 1], shuffled each epoch, batches of `--batch` with the last partial one
dropped (22 steps per epoch, as tfdp's pipeline), `--epochs` epochs of SGD with
momentum 0.9 and cosine decay from `--learning_rate` to 0 over the run,
`keras.callbacks.BackupAndRestore` every epoch, and one evaluation on the test
split at the end. No strategy, no tfdp patches: `tfdp.models` does not import
`tfdp.training` or `tfdp._upstream`.

`tfdp.bench.fixed_costs` takes its wall time from outside (process start to
exit); the JSON it writes says where its own time went, in the same spirit
as `tfdp-train`'s phases (no process-start phase: the parent measures it).
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="TFDS data directory holding digits.")
    parser.add_argument("--backup_dir", required=True, help="BackupAndRestore's directory.")
    parser.add_argument("--out", required=True, help="Where the JSON result goes.")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    from tfdp import models
    from tfdp.pipelines import digits

    imported = time.perf_counter()
    builder = digits.Digits(data_dir=args.data_dir)
    if not builder.is_prepared():
        raise SystemExit(f"digits is not prepared in {args.data_dir}: run "
                         f"tfdp.pipelines.digits.prepare({args.data_dir!r}) first.")

    def scale(example):
        return tf.cast(example["image"], tf.float32) / 255.0, example["label"]

    train_size = builder.info.splits["train"].num_examples
    train = (builder.as_dataset(split="train").map(scale, num_parallel_calls=tf.data.AUTOTUNE)
             .shuffle(train_size, seed=args.seed, reshuffle_each_iteration=True)
             .batch(args.batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    test = (builder.as_dataset(split="test").map(scale, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(args.batch).prefetch(tf.data.AUTOTUNE))
    steps_per_epoch = train_size // args.batch

    keras.utils.set_random_seed(args.seed)
    model = models.get("cnn", input_shape=(8, 8, 1), num_classes=10)
    schedule = keras.optimizers.schedules.CosineDecay(
        args.learning_rate, decay_steps=args.epochs * steps_per_epoch)
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=args.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    epoch_ends = []

    class EpochEnds(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter())

    prepared = time.perf_counter()
    model.fit(train, epochs=args.epochs, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(args.backup_dir, save_freq="epoch"), EpochEnds()])
    trained = time.perf_counter()
    evaluation = model.evaluate(test, return_dict=True, verbose=0)
    evaluated = time.perf_counter()
    result = {
        "seconds": {"imports": imported - _STARTED, "data_and_model": prepared - imported,
                    "fit": trained - prepared, "final_eval": evaluated - trained},
        "epoch_seconds": [b - a for a, b in zip([prepared] + epoch_ends[:-1], epoch_ends)],
        "steps_per_epoch": steps_per_epoch,
        "eval": {k: float(v) for k, v in evaluation.items()},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
