"""Pins tfdp's public surface so nothing leaks into it by accident."""

import tfdp

EXPECTED_PUBLIC_NAMES = {
    "BatchConfig",
    "compile",
    "configure_cpu_devices",
    "make_strategy",
    "strategy_info",
    "StrategyInfo",
}


def test_all_is_exactly_the_public_surface():
    assert set(tfdp.__all__) == EXPECTED_PUBLIC_NAMES


def test_every_public_name_resolves():
    for name in tfdp.__all__:
        assert getattr(tfdp, name) is not None, name
