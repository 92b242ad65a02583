"""What every built-in model shares: argument checks and the logits head.

This module owns the validation of the arguments all builders take
(`input_shape`, `num_classes`) and of common options (positive sizes, dropout
rates), with errors that name the model, the argument, the rule, what was
received and the fix; and `logits`, the float32 classification head that
keeps logits float32 under the `mixed_float16`/`mixed_bfloat16` policies. The
architectures themselves are in the family modules.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import keras


def check_input_shape(
    model: str, input_shape, *, rank: int | None = None, expected: str = "", hint: str = ""
) -> tuple[int, ...]:
    """Validates one example's shape (no batch axis) and returns it as a tuple.

    Args:
        model: the model name, for the message.
        input_shape: the shape to check: a sequence of positive integers.
        rank: the required number of dimensions, or `None` for any (>= 1).
        expected: what the shape should look like, e.g. `"(height, width,
            channels)"`, for the message.
        hint: a sentence appended to a rank error, saying what to use instead.

    Returns:
        `input_shape` as a tuple of Python ints.

    Raises:
        ValueError: `input_shape` is not a sequence of positive integers, or
            has the wrong rank.
    """
    try:
        dims = tuple(input_shape)
    except TypeError:
        dims = None
    if (
        not dims
        or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims)
        or not all(d > 0 for d in dims)
    ):
        raise ValueError(
            f"`input_shape` of model {model!r} must be one example's shape "
            f"(without the batch axis): a tuple of positive integers"
            f"{', ' + expected if expected else ''}. Every size must be known: "
            f"pad or resize the examples in the input pipeline. "
            f"Received: input_shape={input_shape!r}"
        )
    dims = tuple(int(d) for d in dims)
    if rank is not None and len(dims) != rank:
        raise ValueError(
            f"`input_shape` of model {model!r} must have {rank} dimension(s)"
            f"{' ' + expected if expected else ''} (without the batch axis). "
            f"Received: input_shape={input_shape!r}.{' ' + hint if hint else ''}"
        )
    return dims


def check_num_classes(model: str, num_classes) -> int:
    """Validates the logit width: an integer >= 2.

    Raises:
        ValueError: `num_classes` is not an integer >= 2.
    """
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, numbers.Integral)
        or num_classes < 2
    ):
        raise ValueError(
            f"`num_classes` of model {model!r} must be an integer >= 2 (one logit "
            f"per class, for SparseCategoricalCrossentropy(from_logits=True); use 2 "
            f"for a binary task). Received: num_classes={num_classes!r}"
        )
    return int(num_classes)


def check_positive_int(model: str, name: str, value) -> int:
    """Validates a size option (units, filters, layers, ...): an integer >= 1.

    Raises:
        ValueError: `value` is not an integer >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"`{name}` of model {model!r} must be an integer >= 1. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_positive_ints(
    model: str, name: str, values, *, allow_empty: bool = False
) -> tuple[int, ...]:
    """Validates a sequence of sizes, e.g. `filters=(32, 64)`.

    Raises:
        ValueError: `values` is not a sequence of integers >= 1 (or is empty
            when `allow_empty` is False).
    """
    if (
        isinstance(values, (str, bytes))
        or not isinstance(values, Sequence)
        or (not values and not allow_empty)
        or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in values
        )
    ):
        raise ValueError(
            f"`{name}` of model {model!r} must be a "
            f"{'' if allow_empty else 'non-empty '}list or tuple of integers >= 1, "
            f"e.g. {name}=(32, 64). Received: {name}={values!r}"
        )
    return tuple(int(v) for v in values)


def check_rate(model: str, name: str, value) -> float:
    """Validates a dropout rate: a number in [0, 1).

    Raises:
        ValueError: `value` is not a number in [0, 1).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(
            f"`{name}` of model {model!r} must be a number in [0, 1) (0 disables "
            f"dropout). Received: {name}={value!r}"
        )
    return float(value)


def check_bool(model: str, name: str, value) -> bool:
    """Validates an on/off option (`remat`, `sync_bn`): True or False.

    Raises:
        ValueError: `value` is not a bool.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` of model {model!r} must be True or False. "
                         f"Received: {name}={value!r}")
    return value


def logits(x, num_classes: int):
    """The classification head: `Dense(num_classes)` computed in float32.

    Args:
        x: features of shape `(batch, features)`, in any compute dtype.
        num_classes: logit width.

    Returns:
        float32 logits of shape `(batch, num_classes)`, also under a mixed
        precision dtype policy (the loss then sees float32).
    """
    return keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
