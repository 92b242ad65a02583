"""Tests for `tfdp.training.step_monitor` on its own.

The monitor in training (fit and Trainer stop at the limit, log skips, never
save non-finite weights) is tested end to end in `test_nonfinite.py`.
"""

import keras
import numpy as np
import pytest

from tfdp.training import step_monitor
from tfdp.training.nonfinite import NonFiniteError


def test_non_finite_variables_names_them():
    variables = [keras.Variable([1.0, np.inf], name="a"), keras.Variable([0.0], name="b"),
                 keras.Variable(np.array([np.nan, 1.0], "float32"), name="c"),
                 keras.Variable(np.array([3], "int64"), name="steps")]
    assert step_monitor.non_finite_variables(variables) == ["a", "c"]
    with pytest.raises(NonFiniteError, match=r"step 12: 2 variable\(s\) hold NaN or Inf \(first: 'a'\)"):
        step_monitor.check_finite_before_save(variables, step=12, owner="me")
    step_monitor.check_finite_before_save(variables[1:2], step=12, owner="me")
