"""What a `tfdp-train` run reports as it goes and leaves behind: progress
lines, TensorBoard scalars and `curves.png`, the same for both loops.

- `FitProgress` (a Keras callback, `--loop=fit`, chief only): every
  `log_every` optimizer steps a line `step 120/440: loss ..., accuracy ...,
  lr ..., 1,234 examples/s, ETA 12 s` (under `tfdp-launch` stdout is not a
  terminal, so Keras' progress bar prints one line per epoch), and the
  scalars `tfdp.Trainer` writes for `--loop=custom`: `loss`, the metrics,
  `learning_rate`, `examples_per_second` under `model_dir/train`, and
  `batch/per_replica`, `batch/replicas`, `batch/accum_steps`, `batch/global`
  at step 0. A resumed run appends to the same directory.
- `write_eval_scalars`: the final evaluation under `model_dir/eval`.
- `plot_curves`: `model_dir/curves.png` from those event files (loss and
  accuracy, train and eval; learning rate) with matplotlib.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Callable

import keras
import tensorflow as tf

from tfdp.training import nonfinite as nonfinite_lib
from tfdp.training import summaries

TRAIN_DIR = "train"
EVAL_DIR = "eval"
CURVES_FILE = "curves.png"


def _learning_rate(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _skipped_steps(optimizer) -> int | None:
    guard = nonfinite_lib.guard_of(optimizer)
    return None if guard is None else int(keras.ops.convert_to_numpy(guard.skipped_steps))


class FitProgress(keras.callbacks.Callback):
    """Progress lines and TensorBoard scalars for `model.fit`, on the chief.

    Args:
        batch: the run's `tfdp.BatchConfig`.
        total_steps: optimizer steps the run plans (for the ETA).
        global_step: returns the optimizer steps taken so far (skipped
            non-finite steps included), as the step of every scalar.
        log_dir: where the event files go (`model_dir/train`); None: none.
        log_every: optimizer steps between progress lines and scalars; the
            line comes at the end of the first execution
            (`steps_per_execution`) that reaches each multiple.
        is_chief: only the chief prints and writes.
        print_fn: where lines go. Defaults to `print`.
    """

    def __init__(self, *, batch, total_steps: int, global_step: Callable[[], int],
                 log_dir: str | None, log_every: int, is_chief: bool,
                 print_fn: Callable[[str], None] = print):
        super().__init__()
        self.batch = batch
        self.total_steps = total_steps
        self.global_step = global_step
        self.log_dir = log_dir
        self.log_every = log_every
        self.is_chief = is_chief
        self.print_fn = print_fn
        self._writer = None

    def on_train_begin(self, logs=None):
        if not self.is_chief:
            return
        step = self.global_step()
        self._last = (time.perf_counter(), step)
        self._next = (step // self.log_every + 1) * self.log_every
        if self.log_dir is not None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
            if step == 0:
                with self._writer.as_default(step=0):
                    summaries.write_batch_layout(self.batch)

    def on_train_batch_end(self, batch, logs=None):
        if not self.is_chief:
            return
        step = self.global_step()
        if step < self._next and step < self.total_steps:
            return
        self._next = (step // self.log_every + 1) * self.log_every
        now = time.perf_counter()
        then, before = self._last
        self._last = (now, step)
        rate = (step - before) * self.batch.global_batch / (now - then) if now > then else 0.0
        values = {name: float(value) for name, value in (logs or {}).items()}
        lr = _learning_rate(self.model.optimizer)
        eta = (self.total_steps - step) * self.batch.global_batch / rate if rate else 0.0
        self.print_fn(
            f"tfdp-train: step {step}/{self.total_steps}: "
            + "".join(f"{name} {value:.4f}, " for name, value in values.items())
            + f"lr {lr:.4g}, {rate:,.0f} examples/s, ETA {eta:.0f} s"
        )
        if self._writer is not None:
            with self._writer.as_default(step=step):
                summaries.write_progress(values, learning_rate=lr, examples_per_second=rate,
                                         skipped_steps=_skipped_steps(self.model.optimizer))

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def write_eval_scalars(model_dir: str, step: int, logs: dict) -> str:
    """Writes the evaluation's metrics at `step` under `model_dir/eval`; returns the dir."""
    directory = os.path.join(model_dir, EVAL_DIR)
    writer = tf.summary.create_file_writer(directory)
    with writer.as_default(step=step):
        for name, value in logs.items():
            tf.summary.scalar(name, float(value))
    writer.close()
    return directory


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file in `directory`,
    by step; a step written twice (a resumed run) keeps its last value."""
    found: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*")),
                       key=os.path.getmtime):
        # Event files are TFRecord files of `Event` protos (read directly:
        # `summary_iterator` logs a deprecation warning on the chief's output).
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                tensor = tf.make_ndarray(value.tensor) if value.HasField("tensor") else value.simple_value
                found.setdefault(value.tag, {})[int(event.step)] = float(tensor)
    return {tag: sorted(points.items()) for tag, points in found.items()}


def plot_curves(model_dir: str, *, steps_per_epoch: int) -> str | None:
    """Writes `model_dir/curves.png`: loss, accuracy and learning rate against
    epochs, train (and eval where written). Returns its path, or None when
    nothing was logged or matplotlib is not installed."""
    train = read_scalars(os.path.join(model_dir, TRAIN_DIR))
    evaluation = read_scalars(os.path.join(model_dir, EVAL_DIR))
    if not train.get("loss"):
        return None
    try:
        # The object API, not pyplot: no backend or global figure state to
        # set up, about 0.3 s less at the end of every run.
        from matplotlib.figure import Figure
    except ImportError:
        return None
    panels = [("loss", "loss"), ("accuracy", "accuracy"), ("learning_rate", "learning rate")]
    figure = Figure(figsize=(13, 3.6))
    axes = figure.subplots(1, 3)
    for axis, (tag, title) in zip(axes, panels):
        for points, label, style in ((train.get(tag), "train", "-"),
                                     (evaluation.get(tag), "eval", "o")):
            if points:
                axis.plot([s / steps_per_epoch for s, _ in points], [v for _, v in points],
                          style, label=label)
        axis.set_title(title)
        axis.set_xlabel("epoch")
        if tag != "learning_rate":
            axis.legend()
    # Fixed margins instead of tight_layout's text measuring (0.1-0.2 s).
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.91, wspace=0.2)
    path = os.path.join(model_dir, CURVES_FILE)
    figure.savefig(path, dpi=90)
    return path
