"""Fixtures for the launcher tests (plain-Python workers, no TensorFlow).

The launcher never touches Keras, so the suite-wide Keras reset in
`tests/conftest.py` (two `gc.collect()` calls, ~0.6 s per test with TensorFlow
loaded) is switched off here.
"""

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Overrides the suite-wide Keras reset with a no-op (see module docstring)."""
    yield


@pytest.fixture
def pid_dir(tmp_path) -> Path:
    """A directory workers write `<name>.pid` files into (see `launch_snippets`)."""
    path = tmp_path / "pids"
    path.mkdir()
    return path
