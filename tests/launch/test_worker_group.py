"""Tests for `tfdp.launch.worker_group` and `tfdp.launch.output`: the process life cycle."""

import io
import os
import signal
import sys

import pytest

from tfdp.launch import output, worker_group
from tfdp.launch.worker_group import WorkerGroup, WorkerSpec
from launch_snippets import PRELUDE
from multiworker import assert_processes_gone, wait_for_files, write_worker_script


@pytest.mark.parametrize(
    "returncode,exit_code,text",
    [
        (0, 0, "exited with code 0"),
        (3, 3, "exited with code 3"),
        (-signal.SIGKILL, 137, "was killed by SIGKILL (exit code 137)"),
        (-signal.SIGTERM, 143, "was killed by SIGTERM (exit code 143)"),
        (-signal.SIGINT, 130, "was killed by SIGINT (exit code 130)"),
    ],
)
def test_exit_codes(returncode, exit_code, text):
    assert worker_group.exit_code_of(returncode) == exit_code
    assert worker_group.describe_returncode(returncode) == text
    assert worker_group.WorkerExit(0, 1, returncode).exit_code == exit_code


def _specs(script, pid_dir, nproc):
    env = dict(os.environ, PID_DIR=str(pid_dir))
    return [WorkerSpec(rank=r, command=(sys.executable, "-u", str(script)),
                       env={**env, "TFDP_RANK": str(r)}) for r in range(nproc)]


def test_rejects_empty_and_duplicate_specs(tmp_path):
    with pytest.raises(ValueError, match="at least one WorkerSpec"):
        WorkerGroup([])
    spec = WorkerSpec(rank=0, command=("true",), env={})
    with pytest.raises(ValueError, match=r"distinct ranks. Received ranks: \[0, 0\]"):
        WorkerGroup([spec, spec])


def test_close_on_error_kills_and_reaps_workers(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE + "time.sleep(60)\n")
    with pytest.raises(RuntimeError, match="boom"):
        with WorkerGroup(_specs(script, pid_dir, 2), stdout=io.BytesIO(),
                         stderr=io.BytesIO()) as group:
            group.start()
            pids = [int(p) for p in wait_for_files(
                [pid_dir / "worker0.pid", pid_dir / "worker1.pid"], timeout=30)]
            assert sorted(group.pids.values()) == sorted(pids)
            raise RuntimeError("boom")
    assert_processes_gone(pids)
    assert sorted(e.rank for e in group.exits) == [0, 1]
    assert all(e.returncode == -signal.SIGKILL for e in group.exits)


def test_start_twice_is_an_error(tmp_path, pid_dir):
    script = write_worker_script(tmp_path, PRELUDE)
    with WorkerGroup(_specs(script, pid_dir, 1), stdout=io.BytesIO(),
                     stderr=io.BytesIO()) as group:
        group.start()
        with pytest.raises(RuntimeError, match="already called"):
            group.start()
        result = group.supervise(grace_period=1.0)
    assert result == worker_group.GroupResult(0, group.exits, None, None)


def test_supervise_reports_first_failure(tmp_path, pid_dir):
    source = PRELUDE + """
if RANK == 2:
    sys.exit(7)
time.sleep(60)
"""
    script = write_worker_script(tmp_path, source)
    err = io.BytesIO()
    with WorkerGroup(_specs(script, pid_dir, 3), stdout=io.BytesIO(), stderr=err) as group:
        group.start()
        result = group.supervise(grace_period=5.0)
    assert result.exit_code == 7
    assert result.failure.rank == 2 and result.failure.returncode == 7
    assert result.signal is None
    # The others were stopped by SIGTERM (no SIGKILL needed) and all were reaped.
    others = {e.rank: e.returncode for e in result.exits if e.rank != 2}
    assert others == {0: -signal.SIGTERM, 1: -signal.SIGTERM}
    assert b"SIGKILL after 5 s" in err.getvalue()
    assert b"still running" not in err.getvalue()


def test_line_sink_completes_lines_and_survives_a_broken_stream():
    stream = io.BytesIO()
    sink = output.LineSink(stream)
    sink.write_line(b"[3] ", b"no newline")
    sink.write_line(b"[3] ", b"newline\n")
    assert stream.getvalue() == b"[3] no newline\n[3] newline\n"
    stream.close()
    sink.write_line(b"[3] ", b"dropped\n")  # does not raise


def test_prefix_pump_copies_a_pipe_until_eof():
    read_fd, write_fd = os.pipe()
    stream = io.BytesIO()
    with os.fdopen(read_fd, "rb") as reader:
        pump = output.PrefixPump(reader, output.LineSink(stream), b"[12] ")
        pump.start()
        with os.fdopen(write_fd, "wb") as writer:
            writer.write(b"a\nb\n\nc")
        pump.join(timeout=10)
        assert not pump.is_alive()
    assert stream.getvalue() == b"[12] a\n[12] b\n[12] \n[12] c\n"


def test_output_tail_keeps_the_last_lines_of_each_stream(tmp_path, pid_dir):
    source = PRELUDE + """
for i in range(30):
    print(f"out {i}", flush=True)
print("the error", file=sys.stderr, flush=True)
"""
    script = write_worker_script(tmp_path, source)
    with WorkerGroup(_specs(script, pid_dir, 1), stdout=io.BytesIO(), stderr=io.BytesIO(),
                     tail_lines=5) as group:
        group.start()
        group.supervise(grace_period=1.0)
    assert group.output_tail(0) == {
        "stdout": [b"out 25\n", b"out 26\n", b"out 27\n", b"out 28\n", b"out 29\n"],
        "stderr": [b"the error\n"]}
    with pytest.raises(KeyError, match="no started worker has rank 3"):
        group.output_tail(3)
