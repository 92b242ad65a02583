"""Worker program for the Slurm time-limit test: trains slowly until Slurm's SIGTERM, then resumes.

Each srun task of the script `tfdp-launch slurm` writes runs

    python time_limit_job.py BACKUP_DIR RESULT_NPZ

as one of the job's MultiWorkerMirroredStrategy workers
(`tfdp.make_strategy()` finds the cluster in srun's SLURM_* variables). It
trains a tiny Keras model with `model.fit` through `tfdp.compile` and
`tfdp.callbacks.BackupAndRestore(BACKUP_DIR)`, which saves and exits 42 on
SIGTERM. In the job's first run (no SLURM_RESTART_COUNT) every step takes at
least `PACE_SECONDS`, so that the job is still training when Slurm's
time-limit signal comes (slurmctld looks at time limits every 30 s); a
requeued run trains at full speed. Each worker prints `[RANK] started at
step S` once the backup is restored, `[RANK] step N` after every step and
`[RANK] done at step N` at the end; the backup's save lines (absl INFO)
name the saved step. When training completes, the same process trains an
uninterrupted reference (same seed, same strategy, no backup) and the chief
writes both final weight sets and the step count to RESULT_NPZ.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

FEATURES, GLOBAL_BATCH = 4, 8
EPOCHS, STEPS_PER_EPOCH = 4, 30
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 120
#: Seconds every step of the first run takes at least: 120 steps last >= 60 s.
PACE_SECONDS = 0.5


def dataset_for_epoch(epoch: int):
    """Global batches of `epoch`, in an order that depends only on `epoch`."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_PER_EPOCH * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    order = np.random.default_rng(100 + epoch).permutation(len(x))
    return tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        GLOBAL_BATCH, drop_remainder=True)


def build_model(strategy):
    import keras

    import tfdp

    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(2)])
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(backup_dir: str, result_path: str) -> None:
    import keras
    from absl import logging

    import tfdp

    logging.set_verbosity(logging.INFO)  # the backup's "saved ... (step N)" lines
    rank = int(os.environ["SLURM_PROCID"])
    first_run = int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0
    strategy = tfdp.make_strategy("multi_worker")
    model = build_model(strategy)

    class Progress(keras.callbacks.Callback):
        """Prints the steps; paces the first run (after the backup's own step end)."""

        def step(self) -> int:
            return int(self.model.optimizer.iterations.numpy())

        def on_train_begin(self, logs=None):
            print(f"[{rank}] started at step {self.step()}", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            print(f"[{rank}] step {self.step()}", flush=True)
            if first_run:
                time.sleep(PACE_SECONDS)

    backup = tfdp.callbacks.BackupAndRestore(backup_dir, save_freq=STEPS_PER_EPOCH)
    model.fit(backup.wrap(dataset_for_epoch), epochs=EPOCHS, verbose=0,
              callbacks=[backup, Progress()])
    steps = int(model.optimizer.iterations.numpy())
    print(f"[{rank}] done at step {steps}", flush=True)
    reference = build_model(strategy)
    for epoch in range(EPOCHS):
        reference.fit(dataset_for_epoch(epoch), epochs=1, verbose=0)
    if rank == 0:
        results = {"steps": steps,
                   "reference_steps": int(reference.optimizer.iterations.numpy())}
        for i, (got, want) in enumerate(zip(model.get_weights(), reference.get_weights())):
            results[f"weight{i}"], results[f"reference{i}"] = got, want
        np.savez(result_path, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
