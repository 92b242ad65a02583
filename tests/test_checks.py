"""Tests for `tfdp._checks`, the argument checks every package shares."""

import numpy as np
import pytest

from tfdp import _checks


def test_echo_cuts_long_values():
    assert _checks.echo("ab") == "'ab'"
    long = _checks.echo("x" * 1000)
    assert long.endswith("...<truncated>")
    assert len(long) == _checks.MAX_ECHO_CHARS + len("...<truncated>")


@pytest.mark.parametrize("value, minimum, expected", [
    (1, 1, 1), (np.int64(3), 1, 3), (0, 0, 0)])
def test_check_int_accepts_and_returns_python_ints(value, minimum, expected):
    result = _checks.check_int("n", value, minimum=minimum)
    assert result == expected and type(result) is int


@pytest.mark.parametrize("value, kwargs, error, message", [
    (0, {}, ValueError, r"^`n` must be a positive integer\. Received: n=0$"),
    (-1, {"minimum": 0}, ValueError, r"^`n` must be an integer >= 0\. Received: n=-1$"),
    (0, {"hint": " (steps)"}, ValueError, r"^`n` must be a positive integer \(steps\)\. "),
    (0, {"allow_none": True}, ValueError, r"^`n` must be a positive integer or None\. "),
    (2.0, {}, TypeError, r"Received: n=2\.0 of type float\.$"),
    (True, {}, TypeError, r"Received: n=True of type bool\.$"),
    ("2", {}, TypeError, r"Received: n='2' of type str\.$"),
])
def test_check_int_rejects_with_the_rule_and_the_value(value, kwargs, error, message):
    with pytest.raises(error, match=message):
        _checks.check_int("n", value, **kwargs)


def test_a_count_of_the_wrong_type_is_also_a_value_error():
    # Callers that caught ValueError before the checks were shared still do.
    with pytest.raises(ValueError):
        _checks.check_int("n", 2.0)
    assert issubclass(_checks.IntegerTypeError, TypeError)


def test_none_only_when_allowed():
    assert _checks.check_int("n", None, allow_none=True) is None
    with pytest.raises(TypeError, match="Received: n=None"):
        _checks.check_int("n", None)
