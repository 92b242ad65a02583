"""Watching the non-finite guard from outside the step: skips logged, the limit enforced, saves refused.

This module owns what the training loops do with the counters of
`tfdp.training.nonfinite`'s optimizer wrappers: `StepMonitor.check`, which a
loop calls after each `tf.function` call (`install_fit_check` does it for
`model.fit`), logs new skips and raises `NonFiniteError` after
`max_consecutive_nonfinite` skips in a row, naming the steps and the usual
fixes (every worker reads the same counters and so raises at the same
point; under local steps, where each replica skips on its own, it raises on
the stop the workers agreed at a synchronisation,
`tfdp.distribute.local_sync`); `check_finite_before_save` refuses to save non-finite weights (which
can still arise from finite gradients that overflow a weight, or with
`nonfinite=None`). Whether a step is skipped is the wrappers' decision.
"""

from __future__ import annotations

from typing import Iterable

import keras
import tensorflow as tf
from absl import logging

from tfdp.training.nonfinite import NonFiniteError, guard_of

_FIXES = (
    "Lower the learning rate (or warm it up), enable loss scaling for float16 "
    "(the mixed_float16 policy does it), clip gradients, or look for NaN/Inf in "
    "the input (e.g. map tf.debugging.check_numerics over the dataset)."
)


def non_finite_variables(variables: Iterable) -> list[str]:
    """Paths (or names) of the floating-point variables holding a NaN or an Inf.

    Reads every variable once (a read of a sync-on-read variable joins a
    collective under MultiWorkerMirroredStrategy: call it on every worker).
    """
    variables = [v for v in variables if tf.as_dtype(v.dtype).is_floating]
    if not variables:
        return []
    finite = tf.stack([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v))) for v in variables])
    return [getattr(v, "path", None) or v.name for v, ok in zip(variables, finite.numpy()) if not ok]


def check_finite_before_save(variables: Iterable, *, step: int, owner: str, last_saved=None) -> None:
    """Raises `NonFiniteError` instead of letting non-finite weights be saved.

    Args:
        variables: what the checkpoint would hold (model weights, optimizer
            variables).
        step: the step the save is for.
        owner: who saves, for the message (e.g. `"tfdp trainer"`).
        last_saved: the newest checkpoint already written, for the message.

    Raises:
        NonFiniteError: some variable is not finite; nothing was written.
    """
    bad = non_finite_variables(variables)
    if not bad:
        return
    kept = f"; the newest checkpoint is still {last_saved}" if last_saved else ""
    raise NonFiniteError(
        f"{owner}: not saving the checkpoint of step {step}: {len(bad)} variable(s) hold "
        f"NaN or Inf (first: {bad[0]!r}){kept}. The weights overflowed from finite "
        f"gradients, or non-finite steps were applied (nonfinite=None). {_FIXES}"
    )


class StepMonitor:
    """Reads a wrapper's counters after each training call; logs skips, raises at the limit.

    Args:
        guard: the wrapper (`guard_of(optimizer)`).
        owner: who trains, for messages (e.g. `"tfdp trainer"`).
        log: log skipped steps (the chief only). Defaults to True.
    """

    def __init__(self, guard, *, owner: str, log: bool = True):
        self._guard = guard
        self._owner = owner
        self._log = log
        self._last_skipped: int | None = None
        self._read_counters = None

    def _read(self) -> tuple[int, int, int, int | None]:
        """`(skipped_steps, consecutive_skipped_steps, iterations, stopped)`, in one call and one copy.

        Runs after every training call: one `tf.function` (traced once)
        reads the int64 scalars into one tensor, where eager reads of the
        (mirrored) variables took about 2.5 times as long. The counters are
        equal on every replica (under local steps, on every replica of this
        worker); reading them holds no collective. `stopped` is the
        exchange's agreed stop (`Exchange.stop_variable`), or None.
        """
        guard = self._guard
        if not guard.built:  # fit builds it in its first step
            return 0, 0, 0, None
        if self._read_counters is None:
            counters = [guard.skipped_steps, guard.consecutive_skipped_steps, guard.iterations]
            stop = guard.exchange.stop_variable
            if stop is not None:
                counters.append(stop)
            self._read_counters = tf.function(
                lambda: tf.stack([tf.cast(tf.convert_to_tensor(c), tf.int64) for c in counters]),
                autograph=False,
            )
        values = self._read_counters().numpy().tolist()
        return (*values[:3], values[3] if len(values) > 3 else None)

    def prime(self) -> None:
        """Takes the current counts as the baseline for `check`'s log lines."""
        self._last_skipped = self._read()[0]

    def check(self) -> int:
        """Logs new skips and stops at the limit; returns the step count.

        Returns:
            Training steps taken (`iterations` + `skipped_steps`: global
            batches consumed, skipped ones included).

        Raises:
            NonFiniteError: `max_consecutive_nonfinite` steps in a row were
                skipped.
        """
        skipped, consecutive, iterations, stopped = self._read()
        step = iterations + skipped
        if self._last_skipped is None:
            self._last_skipped = skipped
        if skipped > self._last_skipped and self._log:
            logging.warning(
                "%s: skipped %d step(s) with a non-finite loss or gradient by step %d "
                "(%d in a row, %d in all); their updates were not applied and "
                "optimizer.iterations did not advance.",
                self._owner, skipped - self._last_skipped, step, consecutive, skipped,
            )
        self._last_skipped = skipped
        limit = self._guard.max_consecutive_nonfinite
        if stopped is not None:
            # Local steps: each replica skips on its own; raise only once every
            # worker knows (at a synchronisation), never alone.
            if stopped:
                raise NonFiniteError(
                    f"{self._owner}: a replica had {limit} training steps in a row with a "
                    f"non-finite (NaN or Inf) loss or gradient, reaching "
                    f"max_consecutive_nonfinite={limit}, and training stopped on every worker "
                    f"at the next synchronisation of the weights. With local steps "
                    f"(sync_every) each replica skips its own non-finite steps, and applies "
                    f"none after the limit (this worker: {skipped} skipped in all, "
                    f"{consecutive} in a row, {iterations} applied); the request to stop rides "
                    f"in the synchronisation's all-reduce, so every worker stopped after the "
                    f"same step. The weights are those of that synchronisation; no checkpoint "
                    f"with non-finite weights was written. {_FIXES}")
            return step
        if consecutive >= limit:
            first = step - consecutive + 1
            raise NonFiniteError(
                f"{self._owner}: {consecutive} training steps in a row (steps {first}-{step}, "
                f"counting global batches from 1) had a non-finite (NaN or Inf) loss or "
                f"gradient on some replica, reaching max_consecutive_nonfinite={limit}; none "
                f"of them was applied, and training stopped. The weights are those after "
                f"step {first - 1} ({skipped} step(s) skipped in all); no checkpoint with "
                f"non-finite weights was written. {_FIXES}"
            )
        return step


def install_fit_check(model: keras.Model, *, log: bool) -> StepMonitor:
    """Makes `model.fit` stop with `NonFiniteError` at the limit (and log skips).

    Sets `model.train_function` to a function that builds the real one on
    its first call (through `model.make_train_function(force=True)`: Keras'
    own, or tfdp's replacement from `tfdp._upstream.keras_train_function`)
    and, after every execution (`steps_per_execution` steps), reads the
    optimizer's counters. Keras' `make_train_function` returns an existing
    `train_function` as it is, and `compile` resets it. Call it right after
    `model.compile`, with `model.optimizer` a wrapper from this module.

    Args:
        model: the compiled model.
        log: log skipped steps (the chief only).

    Returns:
        The monitor, for the other points of `fit` that check the counters
        (`tfdp.training.sync_points`).
    """
    monitor = StepMonitor(guard_of(model.optimizer), owner="tfdp fit", log=log)
    built = None

    def checked(iterator):
        nonlocal built
        if built is None:
            model.make_train_function(force=True)
            built = model.train_function
            model.train_function = checked
            monitor.prime()  # after fit's on_train_begin, so after any restore
        logs = built(iterator)
        monitor.check()
        return logs

    model.train_function = checked
    return monitor
