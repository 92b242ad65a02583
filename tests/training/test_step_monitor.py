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


def test_monitor_reads_the_counters_of_a_mirrored_guard_in_one_traced_call():
    """Every check reads all three counters (fresh values each time) through one function."""
    import tfdp
    from tfdp.training import nonfinite

    strategy = tfdp.make_strategy(cpu_replicas=2)
    with strategy.scope():
        guard = nonfinite.NonFiniteGuard(keras.optimizers.SGD(0.1), max_consecutive_nonfinite=3)
        guard.build([keras.Variable(np.zeros((2,), "float32"))])
    monitor = step_monitor.StepMonitor(guard, owner="me", log=False)
    monitor.prime()
    for skipped, consecutive, iterations in [(0, 0, 4), (2, 1, 7), (5, 2, 9)]:
        guard.skipped_steps.assign(skipped)
        guard.consecutive_skipped_steps.assign(consecutive)
        guard.iterations.assign(iterations)
        assert monitor.check() == iterations + skipped
    guard.consecutive_skipped_steps.assign(3)
    with pytest.raises(NonFiniteError, match=r"3 training steps in a row \(steps 12-14,"):
        monitor.check()
    # One function, traced once: not three eager reads (and no retracing) per training call.
    assert monitor._read_counters.experimental_get_tracing_count() == 1  # pylint: disable=protected-access
