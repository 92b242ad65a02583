"""Tests for `tests/multiworker.py`: the helper must never leave a process."""

import os
import signal
import subprocess

import pytest

from launch_snippets import PRELUDE
from multiworker import (
    TOKEN_VAR,
    LaunchLeftovers,
    LaunchTimeout,
    assert_processes_gone,
    marked_processes,
    python_command,
    start_launch,
    wait_for_files,
    write_worker_script,
)

HANGING_WORKER = """
if RANK == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a TensorFlow worker
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_timeout_kills_launcher_and_workers_and_reports_output(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + HANGING_WORKER)
    with start_launch(python_command(script), nproc=2, env={"PID_DIR": str(pid_dir)},
                      launch_args=["--grace_period", "1"]) as job:
        pids = [int(p) for p in wait_for_files(
            [pid_dir / "worker0.pid", pid_dir / "worker1.pid"], timeout=60, job=job)]
        with pytest.raises(LaunchTimeout) as info:
            job.wait(timeout=0.5)
    message = str(info.value)
    print(message)
    assert "did not finish within 0.5 s" in message
    assert "[0] ready" in message and "[1] ready" in message  # the output so far
    assert "received SIGTERM" in message  # the launcher stopped its workers itself
    assert job.proc.returncode == 143
    assert_processes_gone(pids + [job.pid])
    assert marked_processes(job.token) == []


@pytest.mark.slow
def test_leftover_processes_are_killed_and_reported(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + "print('done')\n")
    with start_launch(python_command(script), nproc=1,
                      env={"PID_DIR": str(pid_dir)}) as job:
        # Stands in for a process the launch failed to clean up: it carries the
        # run's marker (and is our child, so this test can reap it).
        straggler = subprocess.Popen(["sleep", "60"],
                                     env={**os.environ, TOKEN_VAR: job.token})
        try:
            with pytest.raises(LaunchLeftovers) as info:
                job.wait(timeout=60)
        finally:
            straggler_status = straggler.wait(timeout=10)
    assert info.value.pids == [straggler.pid]
    assert straggler_status == -signal.SIGKILL
    assert info.value.result.returncode == 0
    assert info.value.result.worker_stdout(0) == ["done"]
