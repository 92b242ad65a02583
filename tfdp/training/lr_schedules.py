"""Learning rates for large-batch training: batch scaling and warmup.

This module owns two things: `scale_lr`, which turns a learning rate tuned at
one batch size into one for the global batch, and `WarmupSchedule`, a Keras
`LearningRateSchedule` that warms up linearly and then decays. The decay
curves after warmup are Keras's own `CosineDecay`, `PolynomialDecay` and
`PiecewiseConstantDecay`; this module only adds the warmup in front, which
Keras's `CosineDecay(warmup_target=...)` offers for cosine only and with a
zero learning rate at step 0.

Steps are optimizer steps (`optimizer.iterations`), i.e. global batches
applied, counted from 0, on every worker alike. (tfdp's gradient accumulation
applies once per global batch, so it counts optimizer steps too; Keras's own
`gradient_accumulation_steps=k` instead calls schedules with the number of
micro-batches seen, k per update.)
"""

from __future__ import annotations

import math
from typing import Sequence

import keras
from keras import ops

from tfdp import _checks

SCALING_RULES = ("linear", "sqrt", "none")
DECAYS = ("constant", "cosine", "step", "poly")


def scale_lr(
    base_lr: float, base_batch: int, global_batch: int, rule: str = "linear"
) -> float:
    """Scales a learning rate tuned at `base_batch` to `global_batch`.

    - `"linear"`: `base_lr * global_batch / base_batch` (Goyal et al., 2017,
      "Accurate, Large Minibatch SGD"; use it with warmup).
    - `"sqrt"`: `base_lr * sqrt(global_batch / base_batch)` (often used with
      Adam/LAMB).
    - `"none"`: `base_lr`.

    Example:

    >>> scale_lr(0.1, 256, 8192)
    3.2

    Args:
        base_lr: the learning rate tuned at `base_batch`, `> 0`.
        base_batch: the batch size `base_lr` was tuned for, an integer `>= 1`.
        global_batch: the batch summed over all replicas and workers per
            optimizer step, an integer `>= 1`.
        rule: `"linear"`, `"sqrt"` or `"none"`. Defaults to `"linear"`.

    Returns:
        The scaled learning rate, a Python `float`.

    Raises:
        TypeError: `base_lr` is not a number or a batch is not an integer.
        ValueError: `base_lr <= 0`, a batch is `< 1`, or `rule` is unknown.
    """
    base_lr = _checks.check_float("base_lr", base_lr, minimum=0.0, include_minimum=False)
    base_batch = _checks.check_int("base_batch", base_batch, minimum=1)
    global_batch = _checks.check_int("global_batch", global_batch, minimum=1)
    _checks.check_choice("rule", rule, SCALING_RULES)
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


@keras.saving.register_keras_serializable(package="tfdp")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak_lr`, then constant, cosine, step or poly decay.

    With `W = warmup_steps`, `T = total_steps` and optimizer step `s = 0, 1,
    ...`:

    ```
    s <  W:  peak_lr * (s + 1) / W          # never 0; reaches peak at s = W-1
    s >= W:  "constant": peak_lr
             "cosine":   end_lr + (peak_lr - end_lr) * (1 + cos(pi * t / (T-W))) / 2
             "poly":     end_lr + (peak_lr - end_lr) * (1 - t / (T-W)) ** power
             "step":     peak_lr * decay_rate ** (number of boundaries b <= s)
    ```

    where `t = min(s - W, T - W)`, so cosine and poly stay at `end_lr` from
    step `T` on. The decay starts from `peak_lr` at `s = W` (the last warmup
    step is also at `peak_lr`). Step boundaries are absolute optimizer steps:
    the learning rate is multiplied by `decay_rate` from step `b` on.

    Example (Goyal et al.: 5 warmup epochs, /10 at epochs 30, 60, 80):

    ```python
    schedule = tfdp.WarmupSchedule(
        tfdp.scale_lr(0.1, 256, global_batch),
        warmup_epochs=5, steps_per_epoch=steps_per_epoch,
        decay="step",
        decay_boundaries=[e * steps_per_epoch for e in (30, 60, 80)])
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    ```

    Args:
        peak_lr: the learning rate after warmup, `> 0`.
        warmup_steps: optimizer steps of linear warmup, `>= 0` (0: none).
            Defaults to `0`.
        decay: `"constant"`, `"cosine"`, `"step"` or `"poly"`. Defaults to
            `"constant"`.
        total_steps: the optimizer step at which cosine/poly decay reaches
            `end_lr`; required for them, `> warmup_steps`. Optional for
            `"constant"`/`"step"`, where it is only checked against
            `warmup_steps` and the boundaries.
        end_lr: final learning rate of cosine/poly decay, in
            `[0, peak_lr]`. Defaults to `0.0`.
        power: exponent of poly decay, `> 0`. Defaults to `1.0` (linear).
        decay_boundaries: for `"step"`: strictly increasing optimizer steps
            `>= max(warmup_steps, 1)` (and `< total_steps` if given).
        decay_rate: for `"step"`: factor applied at each boundary, in
            `(0, 1]`. Defaults to `0.1`.
        warmup_epochs: alternative to `warmup_steps`: warmup length in
            epochs (may be fractional); needs `steps_per_epoch`. Converted to
            `round(warmup_epochs * steps_per_epoch)` steps.
        steps_per_epoch: optimizer steps per epoch, used only to convert
            `warmup_epochs`.
        name: name scope of the schedule's ops. Defaults to
            `"WarmupSchedule"`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, `decay` is unknown, the
            warmup is not shorter than `total_steps`, an argument another
            decay needs is missing, or one the chosen decay ignores is set.
    """

    def __init__(
        self,
        peak_lr: float,
        *,
        warmup_steps: int = 0,
        decay: str = "constant",
        total_steps: int | None = None,
        end_lr: float | None = None,
        power: float | None = None,
        decay_boundaries: Sequence[int] | None = None,
        decay_rate: float | None = None,
        warmup_epochs: float | None = None,
        steps_per_epoch: int | None = None,
        name: str = "WarmupSchedule",
    ):
        super().__init__()
        self.peak_lr = _checks.check_float(
            "peak_lr", peak_lr, minimum=0.0, include_minimum=False
        )
        self.decay = _checks.check_choice("decay", decay, DECAYS)
        self.warmup_steps = self._resolve_warmup(
            warmup_steps, warmup_epochs, steps_per_epoch
        )
        self.total_steps = self._resolve_total_steps(total_steps)
        self._check_unused(end_lr=end_lr, power=power, decay_boundaries=decay_boundaries,
                           decay_rate=decay_rate)
        self.end_lr = None
        self.power = None
        self.decay_boundaries = None
        self.decay_rate = None
        if self.decay in ("cosine", "poly"):
            self.end_lr = _checks.check_float(
                "end_lr", 0.0 if end_lr is None else end_lr,
                minimum=0.0, maximum=self.peak_lr,
            )
        if self.decay == "poly":
            self.power = _checks.check_float(
                "power", 1.0 if power is None else power,
                minimum=0.0, include_minimum=False,
            )
        if self.decay == "step":
            self.decay_rate = _checks.check_float(
                "decay_rate", 0.1 if decay_rate is None else decay_rate,
                minimum=0.0, maximum=1.0, include_minimum=False,
            )
            self.decay_boundaries = self._resolve_boundaries(decay_boundaries)
        self.name = name
        self._decay_fn = self._make_decay_fn()

    def _resolve_warmup(self, warmup_steps, warmup_epochs, steps_per_epoch) -> int:
        warmup_steps = _checks.check_int("warmup_steps", warmup_steps, minimum=0)
        if warmup_epochs is None and steps_per_epoch is None:
            return warmup_steps
        if warmup_epochs is None or steps_per_epoch is None:
            raise ValueError(
                "`warmup_epochs` and `steps_per_epoch` go together: the warmup "
                "is warmup_epochs * steps_per_epoch optimizer steps. Received: "
                f"warmup_epochs={warmup_epochs!r}, steps_per_epoch="
                f"{steps_per_epoch!r}. Pass both, or pass warmup_steps instead."
            )
        if warmup_steps:
            raise ValueError(
                "Pass either `warmup_steps` or `warmup_epochs`, not both. "
                f"Received: warmup_steps={warmup_steps}, "
                f"warmup_epochs={warmup_epochs!r}."
            )
        warmup_epochs = _checks.check_float("warmup_epochs", warmup_epochs, minimum=0.0)
        steps_per_epoch = _checks.check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        return round(warmup_epochs * steps_per_epoch)

    def _resolve_total_steps(self, total_steps) -> int | None:
        if total_steps is None:
            if self.decay in ("cosine", "poly"):
                raise ValueError(
                    f"`total_steps` is required for decay={self.decay!r}: it is "
                    "the optimizer step at which the decay reaches `end_lr`. "
                    "Received: total_steps=None. Pass e.g. "
                    "total_steps=epochs * steps_per_epoch."
                )
            return None
        total_steps = _checks.check_int("total_steps", total_steps, minimum=1)
        if total_steps <= self.warmup_steps:
            raise ValueError(
                "`total_steps` must be greater than the warmup "
                f"({self.warmup_steps} steps), so that there is something "
                f"after it. Received: total_steps={total_steps}, "
                f"warmup_steps={self.warmup_steps}. Shorten the warmup or "
                "check that both are in optimizer steps, not epochs."
            )
        return total_steps

    def _check_unused(self, **values):
        used_by = {
            "end_lr": ("cosine", "poly"),
            "power": ("poly",),
            "decay_boundaries": ("step",),
            "decay_rate": ("step",),
        }
        for arg, value in values.items():
            if value is not None and self.decay not in used_by[arg]:
                raise ValueError(
                    f"`{arg}` is only used with decay in "
                    f"{', '.join(map(repr, used_by[arg]))}. Received: "
                    f"{arg}={value!r} with decay={self.decay!r}. Remove "
                    f"`{arg}` or change `decay`."
                )

    def _resolve_boundaries(self, received) -> list[int]:
        boundaries = received
        try:
            boundaries = None if isinstance(boundaries, (str, bytes)) else list(boundaries)
        except TypeError:
            boundaries = None
        if not boundaries:
            raise ValueError(
                "`decay_boundaries` must be a non-empty list of optimizer steps "
                "for decay='step'. Received: "
                f"decay_boundaries={received!r}."
            )
        minimum = max(self.warmup_steps, 1)
        checked = [
            _checks.check_int("decay_boundaries[i]", b, minimum=0) for b in boundaries
        ]
        if checked[0] < minimum:
            raise ValueError(
                f"`decay_boundaries` must be optimizer steps >= {minimum} (no "
                f"decay during the {self.warmup_steps}-step warmup or at step "
                f"0). Received: decay_boundaries={checked}."
            )
        if any(b >= a for b, a in zip(checked, checked[1:])):
            raise ValueError(
                "`decay_boundaries` must be strictly increasing. Received: "
                f"decay_boundaries={list(boundaries)!r}."
            )
        if self.total_steps is not None and checked[-1] >= self.total_steps:
            raise ValueError(
                "`decay_boundaries` must be below `total_steps`, or the decay "
                f"never happens. Received: decay_boundaries={checked}, "
                f"total_steps={self.total_steps}. Check that both are in "
                "optimizer steps, not epochs."
            )
        return checked

    def _make_decay_fn(self):
        """The Keras schedule for the decay phase (`None` for constant)."""
        decay_steps = None
        if self.total_steps is not None:
            decay_steps = self.total_steps - self.warmup_steps
        if self.decay == "cosine":
            return keras.optimizers.schedules.CosineDecay(
                self.peak_lr, decay_steps, alpha=self.end_lr / self.peak_lr
            )
        if self.decay == "poly":
            return keras.optimizers.schedules.PolynomialDecay(
                self.peak_lr, decay_steps, end_learning_rate=self.end_lr,
                power=self.power,
            )
        if self.decay == "step":
            # Keras keeps values[i] while step <= boundaries[i]; we document
            # "from step b on", hence b - 1 (steps are integers). Boundaries are
            # absolute steps, so this one is called with the optimizer step.
            return keras.optimizers.schedules.PiecewiseConstantDecay(
                [b - 1 for b in self.decay_boundaries],
                [self.peak_lr * self.decay_rate**i
                 for i in range(len(self.decay_boundaries) + 1)],
            )
        return None

    def __call__(self, step):
        with keras.name_scope(self.name):
            step = ops.cast(step, "float32")
            peak_lr = ops.convert_to_tensor(self.peak_lr, "float32")
            since_warmup = ops.maximum(step - self.warmup_steps, 0.0)
            if self.decay == "constant":
                decayed = peak_lr
            elif self.decay == "step":
                decayed = self._decay_fn(step)
            else:
                decayed = self._decay_fn(since_warmup)
            if self.warmup_steps == 0:
                return decayed
            warmup = peak_lr * (step + 1.0) / float(self.warmup_steps)
            return ops.where(step < self.warmup_steps, warmup, decayed)

    def get_config(self):
        return {
            "peak_lr": self.peak_lr,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
            "total_steps": self.total_steps,
            "end_lr": self.end_lr,
            "power": self.power,
            "decay_boundaries": self.decay_boundaries,
            "decay_rate": self.decay_rate,
            "name": self.name,
        }
