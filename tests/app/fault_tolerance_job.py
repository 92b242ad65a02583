"""Worker program for the fault-tolerance tests: train, get killed, resume.

Run under `tfdp-launch --nproc_per_node N [--max_restarts K]` as

    python fault_tolerance_job.py LOOP OUT_DIR KILLS

- LOOP: `fit` (`tfdp.compile` + `tfdp.callbacks.BackupAndRestore`, a backup
  every `SAVE_EVERY` steps) or `custom` (`tfdp.Trainer`, a checkpoint every
  `SAVE_EVERY` steps). Both keep their state in `OUT_DIR/model`.
- KILLS: comma-separated `ATTEMPT:STEP` pairs (or `-`): on launch attempt
  ATTEMPT (`TFDP_RESTART_COUNT`), the last worker SIGKILLs itself just before
  it trains optimizer step STEP (1-based). `ATTEMPT:STEP:save` instead kills
  the chief in the middle of saving the checkpoint of step STEP: after its
  files are written, before TensorFlow's `checkpoint` state file names it.
  `ATTEMPT:STEP:term` makes the worker send itself SIGTERM instead (a
  preemption: it saves and exits 42). STEP may be `+K`: K steps after the
  step the attempt resumed from. A trailing `@RANK` picks the worker (default:
  the last one; the chief for `save`).

Every worker appends one JSON line per trained batch to
`OUT_DIR/seen-RANK.jsonl`: `{"attempt", "step", "ids"}`; example ids encode
their epoch (`epoch * 1000 + index`). At start it writes the step it resumed
from to `OUT_DIR/start-ATTEMPT-RANK`. When training completes it trains an
uninterrupted reference in the same process (same strategy, no checkpoints)
and writes `OUT_DIR/final-RANK.npz` with both weight sets and the step count.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

FEATURES, CLASSES = 4, 3
NUM_EXAMPLES, GLOBAL_BATCH, EPOCHS = 48, 8, 3
STEPS_PER_EPOCH = NUM_EXAMPLES // GLOBAL_BATCH  # 6
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 18
SAVE_EVERY = 2
ID_STRIDE = 1000  # id = epoch * ID_STRIDE + example index


def dataset_for_epoch(epoch: int):
    """Global batches of `epoch`, in an order that depends only on `epoch`."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(NUM_EXAMPLES,)).astype("int32")
    order = np.random.default_rng(100 + epoch).permutation(NUM_EXAMPLES)
    ids = (epoch * ID_STRIDE + order).astype("float32")[:, None]
    features = np.concatenate([x[order], ids], axis=1)
    return tf.data.Dataset.from_tensor_slices((features, y[order])).batch(
        GLOBAL_BATCH, drop_remainder=True
    )


class Worker:
    """This process's rank, attempt, kill plan and record of trained batches."""

    def __init__(self, out_dir: str, kills: str):
        self.out_dir = out_dir
        self.rank = int(os.environ["TFDP_RANK"])
        self.last_rank = int(os.environ["TFDP_WORLD_SIZE"]) - 1
        self.attempt = int(os.environ.get("TFDP_RESTART_COUNT", "0"))
        self.kill_at = self.kill_in_save = None
        self.kill_signal = signal.SIGKILL
        self._relative = False
        for kill in kills.split(","):
            if kill == "-":
                continue
            kill, _, rank = kill.partition("@")
            attempt, step, *where = kill.split(":")
            if int(attempt) != self.attempt:
                continue
            default_rank = 0 if where == ["save"] else self.last_rank
            if self.rank != (int(rank) if rank else default_rank):
                continue
            self._relative = step.startswith("+")
            if where == ["save"]:
                self.kill_in_save = int(step)
            else:
                self.kill_at = int(step)
                self.kill_signal = signal.SIGTERM if where == ["term"] else signal.SIGKILL
        self.step = self.start = 0  # the optimizer step the next batch trains
        if self.kill_in_save is not None:
            self._arm_kill_in_save()

    def _arm_kill_in_save(self) -> None:
        import tensorflow as tf

        record_state = tf.train.CheckpointManager._record_state
        kill_in_save = self.kill_in_save

        def record_state_or_die(manager):
            if manager.latest_checkpoint.endswith(f"ckpt-{self._absolute(kill_in_save)}"):
                os.kill(os.getpid(), signal.SIGKILL)
            record_state(manager)

        tf.train.CheckpointManager._record_state = record_state_or_die

    def _absolute(self, step: int) -> int:
        return self.start + step if self._relative else step

    def started_at(self, step: int) -> None:
        self.step = self.start = step
        with open(os.path.join(self.out_dir, f"start-{self.attempt}-{self.rank}"), "w") as f:
            f.write(str(step))

    def trained(self, ids) -> None:
        """Called inside the train step, before the batch's gradients exist."""
        self.step += 1
        if self.kill_at is not None and self.step == self._absolute(self.kill_at):
            os.kill(os.getpid(), self.kill_signal)
        record = {"attempt": self.attempt, "step": self.step,
                  "ids": ids.numpy().astype(int).tolist()}
        with open(os.path.join(self.out_dir, f"seen-{self.rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def build_model(worker: Worker | None, seed: int = 11):
    import keras
    import tensorflow as tf

    class IdRecorder(keras.layers.Layer):
        """Drops the id column; tells `worker` which ids a train step uses."""

        def call(self, inputs, training=None):
            if training and worker is not None:
                tf.py_function(worker.trained, [inputs[:, -1]], [])
            return inputs[:, :-1]

        def compute_output_shape(self, input_shape):
            return (*input_shape[:-1], input_shape[-1] - 1)

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES + 1,)), IdRecorder(),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def _seed(worker: Worker | None) -> int:
    """The reference and the first attempt start alike; a restart must not need to."""
    return 11 if worker is None or worker.attempt == 0 else 100 + worker.attempt


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_fit(strategy, worker: Worker | None, model_dir: str | None):
    """Trains with `model.fit`; returns the model and its optimizer step."""
    import keras

    import tfdp

    with strategy.scope():
        model = build_model(worker, seed=_seed(worker))
        tfdp.compile(model, optimizer=keras.optimizers.Adam(0.01), loss=_loss(),
                     steps_per_execution=SAVE_EVERY)
    if model_dir is None:  # the uninterrupted reference
        for epoch in range(EPOCHS):
            model.fit(dataset_for_epoch(epoch), epochs=1, verbose=0)
        return model, int(model.optimizer.iterations.numpy())

    class Started(keras.callbacks.Callback):  # after the backup restored
        def on_train_begin(self, logs=None):
            worker.started_at(int(self.model.optimizer.iterations.numpy()))

    backup = tfdp.callbacks.BackupAndRestore(model_dir, save_freq=SAVE_EVERY)
    model.fit(backup.wrap(dataset_for_epoch), epochs=EPOCHS, verbose=0,
              callbacks=[backup, Started()])
    return model, int(model.optimizer.iterations.numpy())


def train_custom(strategy, worker: Worker | None, model_dir: str | None):
    """Trains with `tfdp.Trainer`; returns the model and its optimizer step."""
    import keras

    import tfdp

    with strategy.scope():
        model = build_model(worker, seed=_seed(worker))
        optimizer = keras.optimizers.Adam(0.01)
    trainer = tfdp.Trainer(
        model, optimizer=optimizer, loss=_loss(), strategy=strategy,
        batch=tfdp.BatchConfig.from_global(GLOBAL_BATCH, strategy.num_replicas_in_sync),
        model_dir=model_dir, steps_per_loop=SAVE_EVERY,
        checkpoint_every=SAVE_EVERY if model_dir else None,
    )
    if worker is not None:
        trainer.restore()
        worker.started_at(trainer.global_step)
    trainer.train(dataset_for_epoch, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH)
    return model, trainer.global_step


def main(loop: str, out_dir: str, kills: str) -> None:
    import tfdp

    worker = Worker(out_dir, kills)
    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=120)
    train = {"fit": train_fit, "custom": train_custom}[loop]
    model, steps = train(strategy, worker, os.path.join(out_dir, "model"))
    reference, _ = train(strategy, None, None)
    results = {"steps": steps}
    for i, (got, want) in enumerate(zip(model.get_weights(), reference.get_weights())):
        results[f"weight{i}"], results[f"reference{i}"] = got, want
    np.savez(os.path.join(out_dir, f"final-{worker.rank}.npz"), **results)


if __name__ == "__main__":
    main(*sys.argv[1:4])
