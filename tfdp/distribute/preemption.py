"""Save-and-exit on SIGTERM, at a step every worker agrees on.

This module owns one decision: after which training step a SIGTERM'd job
saves and exits, so that every worker saves the same step (a save under
MultiWorkerMirroredStrategy is a collective) and then exits with a known code.
What is saved, and where, is the caller's (`save_fn`): `tfdp.Trainer` saves
its checkpoint, `tfdp.callbacks.BackupAndRestore` its backup; one "step" is
one call of `step_end()`, which both make after each `tf.function` call
(`steps_per_loop` / `steps_per_execution` optimizer steps).

- One worker (default strategy, OneDevice, MirroredStrategy): a SIGTERM
  handler sets a flag; the next `step_end()` saves and exits.
- Several workers (MultiWorkerMirroredStrategy with a cluster):
  `tf.distribute.experimental.PreemptionCheckpointHandler`. The worker that
  gets SIGTERM first publishes "save after run N+1" through the coordination
  service and waits until every worker has acknowledged it; each worker saves
  when its own run counter (one run = one `step_end()` call) reaches it, then
  exits. Workers in synchronous training are at most one run apart, so nobody
  has passed that step. Its save goes through `save_fn` (so only the chief
  writes to the backup directory), and its exit through `exit_fn`. Limits of
  that API, kept: on Google Cloud CPU and TPU VMs it does nothing (TensorFlow
  logs "does not support usage with TPU or CPU device on GCP"); on Google
  Cloud GPU VMs it watches maintenance events instead of SIGTERM. `start()`
  warns when it installed no SIGTERM handler.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable

import tensorflow as tf
from absl import logging

#: Exit status after a SIGTERM-triggered save: the restart code
#: `PreemptionCheckpointHandler` uses by default off Google Cloud, and the one
#: Borg-style schedulers treat as "restart me".
PREEMPTION_EXIT_CODE = 42


def _is_cluster(strategy: tf.distribute.Strategy) -> bool:
    resolver = getattr(strategy, "cluster_resolver", None)
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and resolver is not None
        and bool(resolver.cluster_spec().jobs)
    )


class PreemptionWatcher:
    """Notices SIGTERM; `step_end()` then saves and exits on every worker alike.

    Call `start()` once training begins, `step_end()` after every training
    step on every worker, and `stop()` when training ends normally.

    Args:
        strategy: the model's strategy.
        checkpoint: the `tf.train.Checkpoint` that `save_fn` saves (the
            multi-worker handler needs it, and re-reads the latest checkpoint
            of `directory` into it when it starts).
        directory: the directory the chief saves into.
        save_fn: saves the current training state; called on every worker.
        exit_code: the process exits with this status after the save.
        owner: who is saving, at the start of every log line. Defaults to
            `"tfdp"`.
    """

    def __init__(
        self,
        *,
        strategy: tf.distribute.Strategy,
        checkpoint: tf.train.Checkpoint,
        directory: str,
        save_fn: Callable[[], None],
        exit_code: int = PREEMPTION_EXIT_CODE,
        owner: str = "tfdp",
    ):
        self._strategy = strategy
        self._owner = owner
        self._checkpoint = checkpoint
        self._directory = directory
        self._save_fn = save_fn
        self._exit_code = exit_code
        self._handler = None
        self._previous = None
        self._installed = False
        self._sigterm = threading.Event()

    def start(self) -> None:
        """Installs the SIGTERM handling (from the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            logging.warning(
                "%s: training is not running on the main thread, so SIGTERM cannot "
                "be watched; a SIGTERM will not save a checkpoint.", self._owner
            )
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        if _is_cluster(self._strategy):
            self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
                self._strategy.cluster_resolver,
                tf.train.CheckpointManager(self._checkpoint, self._directory, max_to_keep=None),
                termination_config=tf.distribute.experimental.TerminationConfig(
                    exit_fn=self._exit, save_fn=self._save_fn, grace_period=0
                ),
            )
            if signal.getsignal(signal.SIGTERM) is self._previous:
                # On Google Cloud it watches maintenance events (GPU VMs) or
                # nothing (CPU/TPU VMs) instead; keep it for the former.
                logging.warning(
                    "%s: PreemptionCheckpointHandler watches no SIGTERM on this "
                    "platform (a Google Cloud VM); a SIGTERM will not save a checkpoint.",
                    self._owner,
                )
        else:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum, frame):
        del signum, frame
        logging.warning("%s: SIGTERM received; saving after this step.", self._owner)
        self._sigterm.set()

    def _exit(self):
        self._sigterm.clear()  # handled
        self.stop()
        logging.warning(
            "%s: saved after SIGTERM; exiting with code %d.", self._owner, self._exit_code
        )
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(self._exit_code)

    def step_end(self) -> None:
        """After a training step: saves and exits if a SIGTERM asks for it.

        Raises:
            SystemExit: with `exit_code`, after the save.
        """
        if not self._installed:
            return
        if self._handler is not None:
            self._handler.save_checkpoint_if_preempted()
        elif self._sigterm.is_set():
            self._save_fn()
            self._exit()

    def stop(self) -> None:
        """Restores the SIGTERM handler that was in place before `start()`."""
        if not self._installed:
            return
        self._installed = False
        if self._sigterm.is_set():
            logging.warning(
                "%s: SIGTERM arrived after the last training step; training "
                "completed, so nothing was saved for it.", self._owner
            )
        # A handler TensorFlow installed in C++ reads back as None; SIG_DFL is
        # then the closest to "not ours".
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._handler = None
