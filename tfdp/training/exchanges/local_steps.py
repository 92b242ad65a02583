"""The local-step exchange (local SGD, DiLoCo): no gradient crosses; the weights meet every `sync_every` steps.

Each replica applies its own gradients with its own copy of the inner
optimizer's slots, so `exchange` sends nothing: it only lets DiLoCo remember
the weights a window starts from. `finish` counts the step and, after
`sync_every` of them, averages the weights (local SGD) or takes DiLoCo's
outer step, in one exact float32 all-reduce (`tfdp.distribute.local_sync`,
which owns the synchronisation). Overlapped (`overlap_sync=True`,
`tfdp.distribute.overlapped_sync`), the window ends in `after_call`, between
calls of the train function, and its all-reduce runs in a background thread
while the next window computes; `quiesce` waits for it. `sync_pending` synchronises a window cut
short (ends of epochs, evaluation, the end of training); a checkpoint does
not cut it.

Per-replica state: the inner optimizer's slots (and its `iterations`),
which every replica updates with its own gradients, the weights themselves,
which differ inside a window, and the non-finite guard's skip counters and
loss scale (each replica skips on its own): a checkpoint saves every replica's copy
instead of synchronising first, so saving never changes the trajectory.
None of it can be re-cut for another number of replicas. The counter, DiLoCo's anchors and its outer
optimizer's slots are equal on every replica and are the wrapper's own
variables.
"""

from __future__ import annotations

from tfdp.distribute import local_sync as local_sync_lib
from tfdp.training.exchanges import base


class LocalSteps(base.Exchange):
    """Local steps synchronised by `local_sync`.

    Args:
        optimizer: the wrapper it exchanges for; owns the counter and anchors.
        local_sync: the `tfdp.distribute.local_sync.LocalSync`.
    """

    state_repartitions = False
    steps_locally = True

    def __init__(self, optimizer, local_sync: local_sync_lib.LocalSync):
        super().__init__(optimizer)
        self.local_sync = local_sync

    @property
    def state_variables(self) -> list:
        # The skip counters and loss scale too: each replica skips its own
        # non-finite steps, so they (and the inner optimizer's iterations, in
        # its variables) may differ from the others'.
        # Overlapped (overlap_sync): each replica's snapshot of its weights too.
        return (list(self.optimizer.inner_optimizer.variables) + self.local_sync.weights
                + self.local_sync.replica_variables + self.optimizer.verdict_variables())

    @property
    def lost_by_keras_saves(self) -> str:
        return ("each replica's own inner optimizer slots (and, inside a window of "
                "sync_every steps, its own weights)")

    @property
    def extra_optimizer_variables(self) -> list:
        return self.local_sync.outer_variables

    @property
    def tracked_objects(self) -> dict:
        # So that tf.train.Checkpoint tracks the outer optimizer's slots as it
        # tracks the inner optimizer's.
        outer = self.local_sync.outer_optimizer
        return {} if outer is None else {"outer_optimizer": outer}

    @property
    def stop_variable(self):
        return self.local_sync.stopped

    def build(self, variables: list) -> None:
        # The guard's limit is per replica here: the synchronisation agrees on it.
        self.local_sync.build(self.optimizer, variables, stop=self.optimizer.exhausted)

    def exchange(self, step: base.Step) -> base.Step:
        self.local_sync.before_step()
        return step.replace(reduced=True)  # each replica applies its own

    def finish(self, context) -> None:
        self.local_sync.after_step(context)

    def sync_pending(self) -> None:
        self.local_sync.sync_pending()

    def after_call(self) -> None:
        self.local_sync.after_call()

    def quiesce(self) -> None:
        self.local_sync.quiesce()
