"""Tests for `tfdp.launch._proc`: /proc process state, parent-death signal, reaping."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tfdp.launch import _proc
from multiworker import REPO_ROOT

pytestmark = pytest.mark.skipif(_proc._PRCTL is None, reason="needs Linux prctl and /proc")


def test_process_state_tracks_running_zombie_and_reaped():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert _proc.process_state(child.pid) in ("R", "S")
        assert _proc.is_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _proc.process_state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _proc.process_state(child.pid) == "Z"  # dead, not yet waited for
        assert not _proc.is_alive(child.pid)
        assert child.pid in _proc.children_of(os.getpid())
    finally:
        child.wait()
    assert _proc.process_state(child.pid) is None
    assert not _proc.signal_group(child.pid, signal.SIGTERM)  # no such group


# A middle process starts a grandchild with the parent-death hook, prints its
# pid, then waits; the test SIGKILLs the middle one.
MIDDLE = """
import subprocess, sys, time
from tfdp.launch import _proc
child = subprocess.Popen(["sleep", "60"], preexec_fn=_proc.parent_death_signal_hook())
print(child.pid, flush=True)
time.sleep(60)
"""


def test_worker_dies_with_a_sigkilled_parent():
    # Adopt the orphan ourselves for the duration of the test, so it can be
    # reaped here instead of becoming a zombie under PID 1.
    assert _proc.set_child_subreaper(True)
    try:
        middle = subprocess.Popen(
            [sys.executable, "-c", MIDDLE], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        grandchild = int(middle.stdout.readline())
        middle.kill()
        middle.wait()
        middle.stdout.close()
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            pid, status = os.waitpid(grandchild, os.WNOHANG)
            if pid:
                break
            time.sleep(0.02)
        else:
            os.kill(grandchild, signal.SIGKILL)
            os.waitpid(grandchild, 0)
            pytest.fail("the grandchild survived its SIGKILLed parent")
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        _proc.set_child_subreaper(False)
