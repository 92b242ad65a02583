"""Argument checks shared by the whole of tfdp: library, pipelines, launcher.

This module owns only the wording and the rules of argument checks (counts,
numbers in a range, booleans, choices) and how an error message echoes a
received value, so every part of tfdp rejects bad input with the same
Keras-style message: the argument, the rule, what was received. It imports
neither TensorFlow nor anything else of tfdp, so the launcher can use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

#: Longest `repr` an error message quotes before cutting it short.
MAX_ECHO_CHARS = 300


class IntegerTypeError(TypeError, ValueError):
    """A count that is not an integer (`2.0`, `"2"`, `True`).

    A `TypeError`, and also a `ValueError`: several tfdp functions raised
    `ValueError` for every bad count before their checks were shared here, and
    code catching that keeps working.
    """


def echo(value: Any) -> str:
    """How an error message shows a received value: its `repr`, cut at 300 characters."""
    text = repr(value)
    if len(text) > MAX_ECHO_CHARS:
        text = text[:MAX_ECHO_CHARS] + "...<truncated>"
    return text


def check_float(
    name: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    include_minimum: bool = True,
    include_maximum: bool = True,
) -> float:
    """Checks that `value` is a finite real number in a range.

    Args:
        name: the argument's name, for the error message.
        value: the value received.
        minimum: lower bound, or `None` for no lower bound.
        maximum: upper bound, or `None` for no upper bound.
        include_minimum: whether `value == minimum` is allowed.
        include_maximum: whether `value == maximum` is allowed.

    Returns:
        `value` as a Python `float`.

    Raises:
        TypeError: `value` is not a real number (booleans are rejected too).
        ValueError: `value` is not finite or is outside the range.
    """
    rule = "a finite number"
    if minimum is not None or maximum is not None:
        low = "" if minimum is None else f"{'[' if include_minimum else '('}{minimum}"
        high = "" if maximum is None else f"{maximum}{']' if include_maximum else ')'}"
        if minimum is None:
            rule += f" {'<=' if include_maximum else '<'} {maximum}"
        elif maximum is None:
            rule += f" {'>=' if include_minimum else '>'} {minimum}"
        else:
            rule += f" in the range {low}, {high}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be {rule}. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    value = float(value)
    too_low = minimum is not None and (
        value < minimum or (value == minimum and not include_minimum)
    )
    too_high = maximum is not None and (
        value > maximum or (value == maximum and not include_maximum)
    )
    if not math.isfinite(value) or too_low or too_high:
        raise ValueError(f"`{name}` must be {rule}. Received: {name}={value!r}")
    return value


def check_int(name: str, value, *, minimum: int = 1, allow_none: bool = False,
              hint: str = "") -> int | None:
    """Checks that `value` is an integer `>= minimum` (booleans rejected).

    The message says "a positive integer" when `minimum` is 1 and "an integer
    >= minimum" otherwise.

    Args:
        name: the argument's name, for the error message.
        value: the value received; NumPy integers are accepted.
        minimum: the smallest allowed value. Defaults to 1.
        allow_none: whether `None` is accepted (and returned). Defaults to False.
        hint: text added after the rule, e.g. `" (1 means no accumulation)"`.

    Returns:
        `value` as a Python `int`, or `None` when allowed and received.

    Raises:
        IntegerTypeError: `value` is not an integer (a `TypeError` and a `ValueError`).
        ValueError: `value < minimum`.
    """
    if value is None and allow_none:
        return None
    rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    rule += " or None" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise IntegerTypeError(
            f"`{name}` must be {rule}{hint}. Received: {name}={echo(value)} "
            f"of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be {rule}{hint}. Received: {name}={echo(value)}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """Checks that `value` is a `bool` (not a truthy string or number).

    Raises:
        TypeError: `value` is not a `bool`.
    """
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be True or False. Received: {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    return value


def check_choice(name: str, value, choices) -> str:
    """Checks that `value` is one of `choices`.

    Raises:
        ValueError: `value` is not one of `choices`; the message lists them.
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(map(repr, choices))}. "
            f"Received: {name}={value!r}"
        )
    return value
