"""Fixtures for the launcher tests (plain-Python workers, no TensorFlow)."""

from pathlib import Path

import pytest


@pytest.fixture
def pid_dir(tmp_path) -> Path:
    """A directory workers write `<name>.pid` files into (see `launch_snippets`)."""
    path = tmp_path / "pids"
    path.mkdir()
    return path
