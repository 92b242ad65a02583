"""Pins tfdp's public surface so nothing leaks into it by accident."""

import subprocess
import sys

import tfdp

EXPECTED_PUBLIC_NAMES = {
    "BatchConfig",
    "callbacks",
    "compile",
    "compression",
    "configure_cpu_devices",
    "make_strategy",
    "optimizers",
    "predict",
    "PredictionSummary",
    "read_predictions",
    "scale_lr",
    "strategy_info",
    "StrategyInfo",
    "Trainer",
    "WarmupSchedule",
}


def test_all_is_exactly_the_public_surface():
    assert set(tfdp.__all__) == EXPECTED_PUBLIC_NAMES


def test_every_public_name_resolves():
    for name in tfdp.__all__:
        assert getattr(tfdp, name) is not None, name
    assert tfdp.optimizers.LARS and tfdp.optimizers.LAMB
    assert tfdp.compression.PowerSGD and tfdp.compression.TopK


def test_unknown_names_raise_attribute_error():
    try:
        tfdp.not_a_name  # noqa: B018
    except AttributeError as error:
        assert "not_a_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")


def test_cluster_config_loads_without_tensorflow():
    # The launcher imports tfdp.distribute.cluster; it must start in well under a second.
    code = "import sys, tfdp.distribute.cluster; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "False", result.stderr
