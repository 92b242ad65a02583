"""Runs one benchmark measurement in fresh processes, with a deadline.

This module owns the processes the suite starts: a measurement (a "job" of
`tfdp.bench.worker`) runs in a fresh Python process, or in N worker processes
started by the real launcher (`tfdp-launch --nproc_per_node N`), and
hands back the JSON the chief (rank 0) wrote. Every process gets a timeout;
on timeout, an error or an interrupt the whole process group is stopped
(SIGTERM, which the launcher forwards to its workers, then SIGKILL) before the
call returns, so nothing outlives it. What a job measures is the case
modules' business; which jobs run is `tfdp.bench.suite`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

#: Seconds between SIGTERM and SIGKILL when a run is stopped.
_GRACE_SECONDS = 5.0
#: Command prefix for multi-worker runs (`through_link`); empty: the host's network.
_link_prefix: tuple[str, ...] = ()
_OUTPUT_TAIL_CHARS = 4000


class JobFailed(RuntimeError):
    """A measurement process exited non-zero or ran past its deadline."""


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    environ = dict(os.environ)
    environ.pop("TF_CONFIG", None)  # the launcher sets it; single processes run alone
    root = str(Path(__file__).resolve().parents[2])
    paths = [root] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environ["KERAS_BACKEND"] = "tensorflow"
    environ.update(extra or {})
    return environ


def _tail(text: str) -> str:
    return text if len(text) <= _OUTPUT_TAIL_CHARS else "..." + text[-_OUTPUT_TAIL_CHARS:]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after the grace period; reaps."""
    for signum, wait in ((signal.SIGTERM, _GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    process.wait()


def run_command(
    command: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> str:
    """Runs `command` to completion in its own process group; returns its stdout.

    Args:
        command: argv.
        timeout: seconds before the process group is stopped.
        env: extra environment variables.

    Returns:
        The command's standard output (text).

    Raises:
        JobFailed: non-zero exit status or timeout (with the output's tail).
    """
    start = time.monotonic()
    process = subprocess.Popen(
        list(command), env=_environment(env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(process)
        stdout, stderr = process.communicate()
        raise JobFailed(
            f"`{' '.join(command)}` did not finish within {timeout:g} s and was stopped. "
            f"Raise the deadline (--timeout_scale) on a slower or busier machine.\n"
            f"--- stderr (tail) ---\n{_tail(stderr)}"
        ) from None
    except BaseException:  # KeyboardInterrupt included: leave nothing running
        _stop(process)
        raise
    if process.returncode != 0:
        raise JobFailed(
            f"`{' '.join(command)}` exited with status {process.returncode} after "
            f"{time.monotonic() - start:.1f} s.\n--- stdout (tail) ---\n{_tail(stdout)}\n"
            f"--- stderr (tail) ---\n{_tail(stderr)}"
        )
    return stdout


@contextlib.contextmanager
def through_link(prefix: Sequence[str]) -> Iterator[None]:
    """Within the block, every multi-worker run starts as `prefix + command`.

    `prefix` is `tfdp.bench.link.shaped_link`'s (`ip netns exec NAME`): the
    launcher and its workers then run inside the shaped namespace and
    all-reduce over its loopback. Single-process runs stay outside: they do
    not communicate.
    """
    global _link_prefix
    previous, _link_prefix = _link_prefix, tuple(prefix)
    try:
        yield
    finally:
        _link_prefix = previous


def run_job(
    job: str,
    spec: Mapping,
    *,
    timeout: float,
    nproc: int | None = None,
    env: Mapping[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> dict:
    """Runs `python -m tfdp.bench.worker JOB` and returns what rank 0 wrote.

    Args:
        job: a job name from `tfdp.bench.worker.JOBS`.
        spec: the job's JSON-serialisable arguments.
        timeout: seconds before every process of the run is stopped.
        nproc: run on this many worker processes through `tfdp-launch`
            (each gets TF_CONFIG and `TFDP_RANK`); `None` (default) runs one
            plain process without TF_CONFIG.
        env: extra environment variables.
        wrap: a command prefix each process runs the job under, e.g.
            `python -m tfdp.bench.straggler --rank 0 --cpu_fraction 0.5 --`
            (under `tfdp-launch`, inside each worker). Defaults to none.

    Returns:
        The job's result dictionary.

    Raises:
        JobFailed: a process failed or the run timed out.
    """
    with tempfile.TemporaryDirectory(prefix="tfdp-bench-") as directory:
        out = os.path.join(directory, "result.json")
        command = [*wrap, sys.executable, "-m", "tfdp.bench.worker", job,
                   "--spec", json.dumps(dict(spec)), "--out", out]
        if nproc is not None:
            command = [*(_link_prefix if nproc > 1 else ()),
                       sys.executable, "-m", "tfdp.launch", "--nproc_per_node", str(nproc),
                       "--grace_period", str(_GRACE_SECONDS), "--", *command]
        run_command(command, timeout=timeout, env=env)
        if not os.path.exists(out):
            raise JobFailed(f"job {job!r} exited 0 but wrote no result to {out}.")
        with open(out) as f:
            return json.load(f)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
