"""Fixtures shared by the tests of `tfdp-train`."""

import pytest
from absl import flags


@pytest.fixture
def parse_flags():
    """Parses `tfdp-train` flags (the test module imports `tfdp.app.train`); resets them after."""
    def parse(*argv):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["tfdp-train", *argv])

    yield parse
    flags.FLAGS.unparse_flags()
