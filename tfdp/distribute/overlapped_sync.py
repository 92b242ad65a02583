"""Overlapped local SGD / DiLoCo: a window's all-reduce runs while the next window computes.

`tfdp.distribute.local_sync.LocalSync` stops every replica at the end of a
window until the weights' all-reduce is back. `OverlappedSync` (made by
`local_sync.make(..., overlap=True)`) starts that all-reduce instead, in a
background thread, and applies its result one window late: the one-outer-step
delayed DiLoCo that Streaming DiLoCo (Douillard et al. 2025, arXiv
2501.18512, Sec. 2.3, "overlapping communication with computation", there
with an overlap of τ inner steps) and the eager-updates paper (Kale,
Douillard & Donchev 2025, arXiv 2502.12996, its delayed outer gradients,
without their eager local proxy) build on. Here the overlap is a whole
window (τ = `sync_every`) and the merge keeps each replica's own progress.

The algorithm, per replica m, with A the anchor (the global weights, equal
on every replica), θ_m the replica's weights, H = `sync_every`:

1. At the end of window t (H local steps since the last turn), if window
   t−1's sums have arrived: A ← outer(A, A − mean σ) for DiLoCo (the outer
   optimizer's step along the averaged pseudo-gradient, Douillard et al.
   2023, Algorithm 1), or A ← mean σ for local SGD; then
   θ_m ← A + (θ_m − σ_m): the progress the replica made since its snapshot
   is carried onto the new anchor (not mixed with weight α as in Streaming
   DiLoCo's merge, not dropped).
2. Snapshot: σ_m ← θ_m (and this replica's request to stop), and start the
   all-reduce SUM of the σ_m (and requests) in a background thread. The
   pseudo-gradient of window t is A − σ_m = −(progress over window t).
3. Window t+1's inner steps run meanwhile; its end applies window t's sums
   (1.) before it snapshots (2.).

`sync_pending` (ends of epochs, evaluation, the end of training) flushes:
waits for the all-reduce in flight, applies it (1.), then closes the
current window as `LocalSync` does, with a blocking all-reduce (θ_m ← A ←
outer(A, A − mean θ)). Afterwards nothing is pending and every replica holds
the same weights. The NumPy reference is `numpy_overlapped_training` in
tests/training/test_overlapped_sync.py.

Where it runs. The window ends are taken in Python between calls of the
train function (`after_call`: Keras' batch end under `tfdp.compile`, after
each call in `tfdp.Trainer`), never inside it, so a window ends after the
call in which its H-th step ran (exactly every H steps when the steps per
call divide H; the option rules refuse the others). The all-reduce is a
`tf.function` of its own, traced in the main thread (so every worker assigns
its collective keys in the same order) and run in a `threading.Thread`.
This is public API: under MultiWorkerMirroredStrategy an all-reduce
from a background thread runs while the main thread computes (measured,
issue 34). Local steps launch no weight collective of their own; the main
thread's small per-call ones (Keras' log reduction, the distributed
iterator's end-of-data check) ran beside the thread's in the 2-worker test
of `tests/training/test_multiworker_training.py` without a hang. Every
point that launches a weight collective (`sync_pending`, saves) first calls
`quiesce`, which waits for the thread.

Stopping. The requests to stop ride in the all-reduce as in `LocalSync`,
and are agreed when it is applied, one window later; then the window is
flushed at once (as `sync_pending`), so the loops raise with the weights
synchronised.

Checkpoints. `quiesce` before a save; the snapshot σ_m and the stop request
are per-replica state (`state_variables`), the arrived sums, the anchors and
`pending` (a sum is to be applied) the wrapper's own variables; a run resumed
from a save inside a window applies the same sums at the same step.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfdp._upstream import keras_optimizer_reduction
from tfdp.distribute import reduction


class Overlap:
    """What overlapping adds to `tfdp.distribute.local_sync.LocalSync` (see the module docstring).

    A mixin: `local_sync.OverlappedSync` is `(Overlap, LocalSync)`, so that
    `local_sync` (which makes either from the arguments or a config) imports
    this module and not the other way round. It uses the `LocalSync`'s
    counter, anchors, outer optimizer, stop and blocking `sync_pending`.

    Args:
        sync_every: local optimizer steps per window (≥ 1).
        outer_optimizer: `None` for local SGD, or DiLoCo's outer optimizer.
    """

    overlap = True

    def __init__(self, sync_every: int, outer_optimizer=None):
        super().__init__(sync_every, outer_optimizer)
        self.snapshots: list = []   # σ_m, per replica
        self.received: list = []    # the sums of the σ_m (and requests to stop)
        self.pending = None         # int64: 1 while a snapshot's sums are to be applied
        self._request = None        # float32 [1]: this replica's request at the snapshot
        self._thread = None
        self._error = None
        self._functions = None

    def __repr__(self) -> str:
        return (f"LocalSync(sync_every={self.sync_every}, outer_optimizer="
                f"{self.outer_optimizer!r}, overlap=True)")

    def build(self, owner: keras.optimizers.Optimizer, variables: Sequence,
              stop: Callable[[], tf.Tensor] | None = None) -> None:
        super().build(owner, variables, stop=stop)
        self.snapshots = [owner.add_variable(shape=v.shape, dtype=v.dtype, initializer="zeros",
                                             aggregation="none",
                                             name=f"{_name(v)}_snapshot")
                          for v in self._variables]
        self.received = [owner.add_variable(shape=(math.prod(v.shape),),
                                            dtype=v.dtype, initializer="zeros",
                                            aggregation="none",
                                            name=f"{_name(v)}_received")
                         for v in self._variables]
        self.received.append(owner.add_variable(shape=(1,), dtype="float32",
                                                initializer="zeros", aggregation="none",
                                                name="stop_received"))
        self._request = owner.add_variable(shape=(1,), dtype="float32", initializer="zeros",
                                           aggregation="none", name="stop_snapshot")
        self.pending = owner.add_variable(shape=(), dtype="int64", initializer="zeros",
                                          aggregation="none", name="sync_in_flight")

    @property
    def replica_variables(self) -> list:
        """Per-replica state beyond the weights: each replica's snapshot and request to stop."""
        return [*self.snapshots, self._request]

    # --- in the train step -------------------------------------------------

    def _window_starts(self) -> tf.Tensor:
        """A fresh start (nothing pending) opens a window; a turn keeps the anchor it had."""
        return tf.logical_and(tf.equal(self.steps_since_sync, 0), tf.equal(self.pending, 0))

    def after_step(self, context: tf.distribute.ReplicaContext) -> None:
        """Counts a local step; the window's end is `after_call`'s, outside the step."""
        del context
        self.steps_since_sync.assign_add(1)

    # --- between calls, in Python -------------------------------------------

    def after_call(self) -> None:
        """After a call of the train function: at a window's end, turns (apply, snapshot, send).

        Runs on every worker alike (the counter is equal everywhere).
        """
        if self.steps_since_sync is None:
            return
        if int(self.steps_since_sync.numpy()) < self.sync_every:
            return
        self._apply_arrived()
        if self.stopped is not None and int(self.stopped.numpy()):
            self.sync_pending()  # agreed to stop: close this window too, now
            return
        functions = self._built_functions()
        functions["snapshot"]()
        self._start(functions["reduce"])

    def quiesce(self) -> None:
        """Waits for the all-reduce in flight (if any); the main thread may then launch collectives."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                "tfdp overlapped local steps: the weights' all-reduce of the last window "
                f"failed in its background thread: {error}") from error

    def sync_pending(self) -> None:
        """Flushes: waits for the all-reduce in flight, applies it, and closes the current window."""
        if self.steps_since_sync is None:
            return
        self._apply_arrived()
        super().sync_pending()  # a blocking all-reduce if a step was taken since the turn

    # --- the pieces ------------------------------------------------------------

    def _apply_arrived(self) -> None:
        self.quiesce()
        if int(self.pending.numpy()):
            self._built_functions()["apply"]()

    def _start(self, function) -> None:
        def run():
            try:
                function()
            except BaseException as error:  # pylint: disable=broad-except
                self._error = error

        # A daemon: if a peer died the collective never returns, and the
        # process must still be able to exit with the error of its main thread.
        self._thread = threading.Thread(target=run, name="tfdp-overlapped-sync", daemon=True)
        self._thread.start()

    def _built_functions(self) -> dict:
        if self._functions is None:
            run = self._strategy.run
            self._functions = {
                "snapshot": tf.function(lambda: run(self._snapshot), autograph=False),
                "reduce": tf.function(lambda: run(self._reduce), autograph=False),
                "apply": tf.function(lambda: run(self._apply), autograph=False),
            }
            # Traced here, in the main thread, in the same order on every
            # worker: tracing assigns the all-reduce's collective keys. The
            # thread calls the concrete function, so it can never trace again
            # (a tf.function's cache key includes thread-local context).
            self._functions["reduce"] = self._functions["reduce"].get_concrete_function()
        return self._functions

    def _snapshot(self):
        for snapshot, variable in zip(self.snapshots, self._variables):
            snapshot.assign(variable)
        if self._stop is not None:
            self._request.assign(tf.reshape(tf.cast(self._stop(), tf.float32), [1]))
        self.steps_since_sync.assign(0)
        self.pending.assign(1)

    def _reduce(self):
        context = tf.distribute.get_replica_context()
        # tf.identity: tensors on the replica's device (see LocalSync._values).
        values = [tf.reshape(tf.identity(s), [-1]) for s in self.snapshots]
        values.append(tf.identity(self._request))
        sums = reduction.all_reduce_sum(context, values)  # one batched, exact collective
        for received, total in zip(self.received, sums):
            received.assign(total)

    def _apply(self):
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        *sums, requests = [tf.identity(r) for r in self.received]
        if self.stopped is not None:
            self.stopped.assign(tf.maximum(self.stopped, tf.cast(requests[0] > 0.0, tf.int64)))
        means = [tf.reshape(s / tf.cast(replicas, s.dtype), v.shape)
                 for s, v in zip(sums, self._variables)]
        progress = [variable - snapshot for variable, snapshot in zip(self._variables,
                                                                       self.snapshots)]
        if self.outer_optimizer is None:
            for variable, mean in zip(self._variables, means):
                variable.assign(mean)
        else:
            pseudo_gradients = [anchor - mean for anchor, mean in zip(self.anchors, means)]
            for variable, anchor in zip(self._variables, self.anchors):
                variable.assign(anchor)
            with keras_optimizer_reduction.gradients_already_reduced(self.outer_optimizer):
                self.outer_optimizer.apply(pseudo_gradients, self._variables)
            for anchor, variable in zip(self.anchors, self._variables):
                anchor.assign(variable)
        for variable, carried in zip(self._variables, progress):
            variable.assign_add(carried)
        self.pending.assign(0)

    def get_config(self) -> dict:
        return {**super().get_config(), "overlap": True}


def _name(variable) -> str:
    return getattr(variable, "path", variable.name).replace("/", "_").replace(":", "_")
