"""Keras' own savers beside tfdp's per-replica state: refused where wrong, warned where lossy.

Some of tfdp's optimizer state differs per replica (its exchange's
`state_variables`: a compressor's error-feedback memories, local steps'
inner slots and, inside a window, the weights themselves). tfdp's own
checkpoints (`tfdp.Trainer(model_dir=...)`, `tfdp.callbacks.BackupAndRestore`)
save every replica's copy (`tfdp.training.replica_state`). Keras' savers
cannot: `model.save`, `keras.callbacks.ModelCheckpoint` and
`keras.callbacks.BackupAndRestore` write what the chief's first replica
holds, or nothing of state the optimizer does not list as its variables.

This module owns what tfdp says about them, before anything runs:

- `check_fit_callbacks` (called by the `fit` of a model from
  `tfdp.compile`): a Keras `ModelCheckpoint` or `BackupAndRestore` that saves
  every N batches under local steps is refused, naming it (it would save the
  first replica's unsynchronised weights; synchronising first would change
  the training trajectory); any other Keras saver is warned about, naming it,
  what it loses and what to use instead;
- `warn_model_save` (from the wrappers' `save_own_variables`, which
  `model.save` and both Keras callbacks reach): the same warning once per
  optimizer, for a direct `model.save`.

It does not save anything itself.
"""

from __future__ import annotations

import keras
from absl import logging

#: What to use instead, in every message.
_INSTEAD = ("To resume training exactly, use tfdp.callbacks.BackupAndRestore (model.fit) or "
            "tfdp.Trainer(model_dir=...), which save every replica's copy "
            "(tfdp.training.replica_state); a .keras file or Keras' callbacks are fine for "
            "the final weights or for inference.")


def _flatten(callbacks) -> list:
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    return keras.tree.flatten(callbacks)


def has_state_they_lose(optimizer, strategy) -> bool:
    """Whether `optimizer` (any) keeps per-replica state Keras' savers lose under `strategy`."""
    exchange = getattr(optimizer, "exchange", None)
    return (exchange is not None and strategy.num_replicas_in_sync > 1
            and exchange.lost_by_keras_saves is not None)


def _saves_mid_epoch(callback) -> bool:
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return callback.save_freq != "epoch"
    return getattr(callback, "save_freq", "epoch") != "epoch"  # Keras' BackupAndRestore


def check_fit_callbacks(optimizer, callbacks, *, num_replicas: int) -> None:
    """Refuses or warns about the Keras savers among `fit`'s `callbacks` (see the module docstring).

    Args:
        optimizer: the model's optimizer (a tfdp wrapper or any other).
        callbacks: what `fit` was given (any form it takes).
        num_replicas: the strategy's replicas in sync.

    Raises:
        ValueError: a Keras `ModelCheckpoint` or `BackupAndRestore` with
            `save_freq=<batches>` while the replicas take local steps.
    """
    exchange = getattr(optimizer, "exchange", None)
    if exchange is None or num_replicas < 2:
        return
    lost = exchange.lost_by_keras_saves
    for callback in _flatten(callbacks):
        if not isinstance(callback, (keras.callbacks.ModelCheckpoint,
                                     keras.callbacks.BackupAndRestore)):
            continue
        name = f"keras.callbacks.{type(callback).__name__}"
        if exchange.steps_locally and _saves_mid_epoch(callback):
            raise ValueError(
                f"{name}(save_freq={callback.save_freq!r}) cannot be used with local steps "
                "(sync_every > 1 or an outer_optimizer): in the middle of an epoch the "
                "replicas' weights differ, and it would save the first replica's "
                "unsynchronised copy (synchronising first would change the training "
                f"trajectory). Use tfdp.callbacks.BackupAndRestore(..., save_freq="
                f"{callback.save_freq!r}), which saves every replica's weights and slots, "
                f"or {name}(save_freq='epoch'), whose saves see the weights synchronised "
                "at the end of each epoch.")
        if lost is not None:
            logging.warning(
                "tfdp: %s does not save %s: a run resumed from it starts that state afresh "
                "and does not continue exactly. %s", name, lost, _INSTEAD)


def warn_model_save(optimizer, *, num_replicas: int) -> None:
    """Logs once per optimizer that `model.save` (or a Keras saver) drops its per-replica state.

    Args:
        optimizer: a tfdp optimizer wrapper.
        num_replicas: the replicas in sync of the strategy it was built under.
    """
    lost = optimizer.exchange.lost_by_keras_saves
    if lost is None or num_replicas < 2 or getattr(optimizer, "_tfdp_warned_keras_save", False):
        return
    optimizer._tfdp_warned_keras_save = True  # pylint: disable=protected-access
    logging.warning(
        "tfdp: model.save() / model.save_weights() (also what Keras' ModelCheckpoint and "
        "BackupAndRestore call) does not keep %s; only the weights and the optimizer "
        "state common to every replica are written. %s", lost, _INSTEAD)
