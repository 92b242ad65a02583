"""Shared fixtures for the `pipelines` tests (helpers: `pipeline_testing`)."""

import pytest

from tfdp import pipelines


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """A TFDS data directory with the digits dataset, written once per session."""
    return pipelines.prepare_digits(str(tmp_path_factory.mktemp("tfds")))
