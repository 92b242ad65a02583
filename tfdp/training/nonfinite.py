"""Training steps with a NaN or Inf loss or gradient: skipped everywhere alike.

This module owns what happens to such a step, under every `tf.distribute`
strategy:

- **the decision**, the same on every replica and worker. The optimizer
  wrappers here all-reduce the gradients themselves (the one all-reduce the
  step has anyway), check the *summed* gradients, and only then let the
  wrapped optimizer apply them (`tfdp._upstream.keras_optimizer_reduction`).
  A NaN or Inf on any replica is in the sum every replica receives, and every
  TensorFlow all-reduce hands every replica the same sum, so all of them take
  the same branch: no extra collective, and a worker never waits alone in a
  collective the others skipped. The branch is a `tf.cond` in cross-replica
  context (through `merge_call`, as Keras' `LossScaleOptimizer._tf_apply`
  does), because Keras cannot run `apply_gradients` inside a `tf.cond` in
  replica context under MirroredStrategy (keras-team/keras#20582). A
  non-finite *loss* is folded into one gradient by `fold_loss_into_gradients`
  (tfdp's own train steps do this), so it is caught by the same check.
  With local steps (`sync_every`, `tfdp.distribute.local_sync`) nothing is
  all-reduced per step: each replica decides on its own gradients, and the
  limit below is agreed at the next synchronisation instead.
- **counting**: a skipped step leaves the weights, the optimizer slots and
  `optimizer.iterations` unchanged (so learning-rate schedules and
  `iterations` count applied updates only) and adds one to the wrapper's
  `skipped_steps` and `consecutive_skipped_steps` variables, which are
  optimizer variables and so are checkpointed and restored with it.
- **stopping**: after `max_consecutive_nonfinite` skips in a row the wrapper
  applies nothing more (it is "exhausted"). Reading the counters after each
  training call, logging skips and raising `NonFiniteError` at the limit is
  `tfdp.training.step_monitor`'s, as is refusing to save non-finite weights.

Where each part lives (this module gathers their public names):

- the verdict, its counters and the argument checks: `tfdp.training.verdict`;
- the step, exchange -> verdict -> apply -> finish:
  `tfdp.training.optimizer_step`, with the exchanges of the gradients
  (all-reduce, compressors, ZeRO-1, local steps) in
  `tfdp.training.exchanges`;
- the wrappers: `tfdp.training.guard_optimizer.NonFiniteGuard` and
  `tfdp.training.loss_scaling.NonFiniteLossScaleOptimizer` (the loss
  scale); `wrap_optimizer` and `guard_of`: `tfdp.training.wrapping`.

It does not own when steps run or checkpoints are saved (`tfdp.Trainer`,
`tfdp.compile` with `tfdp.callbacks.BackupAndRestore`).

Not undone by a skip: what the forward pass itself updates (metrics,
`BatchNormalization` moving statistics, any layer state assigned in `call`).
The skipped step's loss enters the logged mean (NaN), and a NaN input leaves
NaN moving statistics, which `check_finite_before_save` then refuses to save.

Cost per optimizer step: no collective; one `is_finite` reduction over the
summed gradients (one read of them, like one elementwise op) and a `tf.cond`.
Gradient clipping (`clipnorm`, `global_clipnorm`) of the wrapped optimizer
then applies to the summed gradient, as on one device, instead of each
replica's share as Keras' own `apply` under a strategy does.
"""

from tfdp.training.guard_optimizer import NonFiniteGuard
from tfdp.training.loss_scaling import NonFiniteLossScaleOptimizer
from tfdp.training.verdict import (
    DEFAULT_MAX_CONSECUTIVE,
    MODES,
    NO_LIMIT,
    NonFiniteError,
    check_arguments,
    check_values,
    fold_loss_into_gradients,
)
from tfdp.training.wrapping import guard_of, wrap_optimizer

__all__ = [
    "DEFAULT_MAX_CONSECUTIVE",
    "MODES",
    "NO_LIMIT",
    "NonFiniteError",
    "NonFiniteGuard",
    "NonFiniteLossScaleOptimizer",
    "check_arguments",
    "check_values",
    "fold_loss_into_gradients",
    "guard_of",
    "wrap_optimizer",
]
