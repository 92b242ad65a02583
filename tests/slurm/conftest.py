"""The `slurm` fixture: one real one-node Slurm cluster for the whole session.

It needs Debian's `slurm-wlm` and `munge` (`.ci/run` installs them); without
their programs every test using it is skipped, saying which are missing, unless
`TFDP_REQUIRE_SLURM=1` (set by `.ci/run`) makes that an error.
The cluster runs in its own process (`slurm_cluster.py`), which stops every
daemon it started and removes its directory at the end of the session,
also when tests fail.
"""

import os
import warnings

import pytest

import slurm_cluster


@pytest.fixture(scope="session")
def slurm():
    """A `slurm_cluster.ClusterProcess`: `.env` (with SLURM_CONF), `.run`, `.wait_job`."""
    missing = slurm_cluster.missing_binaries()
    if missing:
        reason = (f"Slurm tests need Slurm and munge: {', '.join(missing)} not on PATH. "
                  "Install them (as root): apt-get install -y slurm-wlm munge")
        if os.environ.get("TFDP_REQUIRE_SLURM") == "1":
            pytest.fail(reason + " (TFDP_REQUIRE_SLURM=1: they must run)")
        pytest.skip(reason)
    cluster = slurm_cluster.ClusterProcess.start()
    try:
        yield cluster
    finally:
        output = cluster.stop()
        if "leftover processes killed: none" not in output:
            warnings.warn(f"the Slurm test cluster did not stop cleanly:\n{output[-3000:]}")
