"""Worker program for the two-worker BackupAndRestore test.

Run under `tfdp-launch --nproc_per_node 2` as

    python backup_multiworker_job.py {train,resume} OUT_DIR

`train`: trains `backup_testing`'s model on a MultiWorkerMirroredStrategy with
`tfdp.compile(accum_steps=2, steps_per_execution=2)` and a
`BackupAndRestore(OUT_DIR/backup, save_freq=4)`, writing `OUT_DIR/step-R`
(this worker's optimizer step) after every batch. From `PAUSE_AFTER` steps on
it sleeps after every batch, so the test has time to SIGTERM the launcher.
When the callback exits the process (SystemExit), the worker first writes
`OUT_DIR/exit-R.json`: the exit code, its optimizer step and the example ids
it trained on.

`resume`: trains the same model uninterrupted (no callback) for reference,
then resumes the backup with a fresh model, and writes `OUT_DIR/rank-R.npz`:
both weight sets, the resumed step count, the ids trained on, and whether the
backup directory still exists.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import backup_testing as bt  # noqa: E402

ACCUM_STEPS, STEPS_PER_EXECUTION, SAVE_FREQ = 2, 2, 10
PAUSE_AFTER, PAUSE_SECONDS = 6, 1.0


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _model(strategy, recorder=None, seed=11):
    with strategy.scope():
        model = bt.build_model(recorder, seed=seed)
        bt.compile_model(model, accum_steps=ACCUM_STEPS, steps_per_execution=STEPS_PER_EXECUTION)
    return model


def train(out_dir: str, strategy, rank: int) -> None:
    import keras

    import tfdp

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            _write(os.path.join(out_dir, f"step-{rank}"), str(step))
            if step >= PAUSE_AFTER:
                time.sleep(PAUSE_SECONDS)

    recorder = bt.Recorder()
    model = _model(strategy, recorder)
    backup = tfdp.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=SAVE_FREQ)
    try:
        model.fit(backup.wrap(bt.dataset_for_epoch), epochs=bt.EPOCHS, verbose=0,
                  callbacks=[bt.epoch_callback(recorder), Progress(), backup])
    except SystemExit as exit_:
        _write(os.path.join(out_dir, f"exit-{rank}.json"), json.dumps({
            "code": exit_.code,
            "step": int(model.optimizer.iterations.numpy()),
            "seen": recorder.seen,
        }))
        raise
    _write(os.path.join(out_dir, f"exit-{rank}.json"), json.dumps({"code": 0}))


def resume(out_dir: str, strategy, rank: int) -> None:
    import tfdp

    reference = _model(strategy)
    for epoch in range(bt.EPOCHS):
        reference.fit(bt.dataset_for_epoch(epoch), epochs=1, verbose=0, shuffle=False)

    recorder = bt.Recorder()
    model = _model(strategy, recorder, seed=5)
    backup_dir = os.path.join(out_dir, "backup")
    backup = tfdp.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)
    model.fit(backup.wrap(bt.dataset_for_epoch), epochs=bt.EPOCHS, verbose=0,
              callbacks=[bt.epoch_callback(recorder), backup])
    results = {
        "steps": int(model.optimizer.iterations.numpy()),
        "backup_exists": os.path.exists(backup_dir),
        "seen": np.asarray(recorder.seen, dtype="int64").reshape(-1, 2),
    }
    for i, (got, want) in enumerate(zip(model.get_weights(), reference.get_weights())):
        results[f"weight{i}"] = got
        results[f"reference{i}"] = want
    np.savez(os.path.join(out_dir, f"rank-{rank}.npz"), **results)


def main(mode: str, out_dir: str) -> None:
    import tfdp

    strategy = tfdp.make_strategy("multi_worker", timeout_seconds=60)
    rank = tfdp.strategy_info(strategy).worker_index
    {"train": train, "resume": resume}[mode](out_dir, strategy, rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
