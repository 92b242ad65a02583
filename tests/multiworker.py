"""Run multi-worker jobs from tests through the real launcher.

Tests that need several worker processes (a 2-worker
`MultiWorkerMirroredStrategy` fit, launcher behaviour) use this module instead
of starting processes themselves. It runs `tfdp-launch --nproc_per_node N
-- COMMAND` exactly as a user would, with a timeout, captures its output, and
guarantees that nothing it started outlives the call:

- on timeout it sends SIGTERM to the launcher (which forwards it to the workers
  and SIGKILLs them after its grace period), then SIGKILLs the launcher if it
  is still there, then SIGKILLs any process still carrying this run's marker
  variable (`TFDP_TEST_LAUNCH_TOKEN`), and raises `LaunchTimeout` with the
  captured output;
- after a normal exit it checks that no process carrying the marker is left
  (that would be a launcher bug), kills any it finds and raises
  `LaunchLeftovers`.

Typical use, in a test (`tmp_path` is pytest's fixture):

    from multiworker import run_worker_script

    def test_two_workers_agree(tmp_path):
        result = run_worker_script(tmp_path, '''
            import os
            print("rank", os.environ["TFDP_RANK"])
        ''', nproc=2, timeout=120, check=True)
        assert result.worker_stdout(1) == ["rank 1"]

A TensorFlow worker script should set up its strategy with
`tfdp.make_strategy("multi_worker")` (TF_CONFIG comes from the launcher), keep
the model tiny and the steps few, and write what the test checks (weights,
metrics) to files under `tmp_path` or print it; `check=True` makes a failure
show every worker's output. Each worker pays ~5 s to import TensorFlow, so give
such a test `timeout=` well above that and mark it `@pytest.mark.slow`.

The workers' environment is this process's, plus `PYTHONPATH` pointing at the
repository (so `import tfdp` works from any `cwd`), `TF_CPP_MIN_LOG_LEVEL=2`
and `KERAS_BACKEND=tensorflow` unless set, minus any inherited `TF_CONFIG`,
plus `env`. The launcher adds TF_CONFIG and the `TFDP_*` rank variables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Default seconds a launch may take before it is killed.
DEFAULT_TIMEOUT = 120.0
#: Environment variable marking every process of one `run_launch` call.
TOKEN_VAR = "TFDP_TEST_LAUNCH_TOKEN"
#: Seconds the launcher gets to stop its workers after our SIGTERM, on top of
#: its own grace period.
_STOP_MARGIN = 10.0
_MAX_OUTPUT_CHARS = 20_000


class LaunchTimeout(AssertionError):
    """The launch did not finish within its timeout; it was killed."""


class LaunchFailed(AssertionError):
    """`check=True` and the launch exited non-zero; `.result` has the output."""

    def __init__(self, message: str, result: "LaunchResult"):
        super().__init__(message)
        self.result = result


class LaunchLeftovers(AssertionError):
    """The launch exited but left processes running (now killed).

    Attributes:
        result: the `LaunchResult`.
        pids: the leftover processes.
    """

    def __init__(self, message: str, result: "LaunchResult", pids: list[int]):
        super().__init__(message)
        self.result = result
        self.pids = pids


class LaunchResult(subprocess.CompletedProcess):
    """A finished launch: `CompletedProcess` plus timing and per-worker output.

    Attributes:
        args, returncode, stdout, stderr: as in `subprocess.CompletedProcess`
            (`stdout` / `stderr` are text, with the launcher's `[rank] `
            prefixes).
        elapsed: wall time of the launch, in seconds.
    """

    def __init__(self, args, returncode, stdout, stderr, *, elapsed: float):
        super().__init__(args, returncode, stdout, stderr)
        self.elapsed = elapsed

    def worker_stdout(self, rank: int) -> list[str]:
        """Lines worker `rank` wrote to stdout, without the `[rank] ` prefix."""
        return _lines_with_prefix(self.stdout, f"[{rank}] ")

    def worker_stderr(self, rank: int) -> list[str]:
        """Lines worker `rank` wrote to stderr, without the `[rank] ` prefix."""
        return _lines_with_prefix(self.stderr, f"[{rank}] ")

    def launcher_messages(self) -> list[str]:
        """The launcher's own `[launch] ` lines (stderr), without the prefix."""
        return _lines_with_prefix(self.stderr, "[launch] ")

    def describe(self) -> str:
        """Everything needed to debug a failed launch, for assertion messages."""
        return _describe(self.args, self.returncode, self.elapsed, self.stdout, self.stderr)


def _lines_with_prefix(text: str, prefix: str) -> list[str]:
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def _tail(text: str) -> str:
    if len(text) <= _MAX_OUTPUT_CHARS:
        return text
    return f"...<{len(text) - _MAX_OUTPUT_CHARS} chars cut>...\n" + text[-_MAX_OUTPUT_CHARS:]


def _describe(args, returncode, elapsed, stdout, stderr) -> str:
    return (
        f"command: {' '.join(map(str, args))}\n"
        f"exit status: {returncode}, after {elapsed:.1f} s\n"
        f"--- stdout ---\n{_tail(stdout)}\n--- stderr ---\n{_tail(stderr)}"
    )


def launch_command(
    command: Sequence[str], *, nproc: int = 2, launch_args: Sequence[str] = ()
) -> list[str]:
    """The argv of `tfdp-launch --nproc_per_node nproc [launch_args] -- command`."""
    return [sys.executable, "-m", "tfdp.launch", "--nproc_per_node", str(nproc),
            *launch_args, "--", *command]


def python_command(script: str | os.PathLike, *args: str) -> list[str]:
    """`[sys.executable, "-u", script, *args]`: run a script with this Python."""
    return [sys.executable, "-u", os.fspath(script), *args]


def _environment(env: Mapping[str, str] | None, token: str) -> dict[str, str]:
    environ = dict(os.environ)
    environ.pop("TF_CONFIG", None)
    paths = [str(REPO_ROOT)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environ.setdefault("KERAS_BACKEND", "tensorflow")
    environ.update(env or {})
    environ[TOKEN_VAR] = token
    return environ


def free_port_pair() -> int:
    """A port P such that P and P + 1 are both free now (skips the test if none)."""
    import socket

    import pytest

    for _ in range(50):
        with socket.socket() as first:
            first.bind(("", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("", port + 1))
                except OSError:
                    continue
        return port
    pytest.skip("no two consecutive free ports found")


def marked_processes(token: str) -> list[int]:
    """Pids of live processes whose environment carries `TOKEN_VAR=token`."""
    needle = f"{TOKEN_VAR}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, a zombie, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry))
    return pids


def process_state(pid: int) -> str | None:
    """State letter of `pid` from /proc (`"Z"` for a zombie), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[0].decode()


def assert_processes_gone(pids: Sequence[int], *, timeout: float = 5.0) -> None:
    """Asserts every pid is gone: neither running nor a zombie.

    Reads /proc (a zombie still answers `kill -0`). Waits up to `timeout`
    seconds, for processes that are being reaped right now.
    """
    deadline = time.monotonic() + timeout
    while True:
        states = {pid: process_state(pid) for pid in pids}
        if all(state is None for state in states.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes still present after {timeout:g} s "
                                 f"(pid: state, Z = zombie): {states}")
        time.sleep(0.05)


def wait_for_files(paths: Sequence[str | os.PathLike], *, timeout: float = 60.0,
                   job: "LaunchProcess | None" = None) -> list[str]:
    """Waits until every file in `paths` exists; returns their stripped contents.

    Workers should write such files atomically (write a temporary file, then
    `os.replace`). If `job` is given and its launcher exits first, fails at
    once with the launch's output instead of waiting for the timeout.

    Raises:
        AssertionError: after `timeout` seconds, or when `job` ended early.
    """
    deadline = time.monotonic() + timeout
    paths = [Path(p) for p in paths]
    while True:
        if all(p.exists() for p in paths):
            return [p.read_text().strip() for p in paths]
        if job is not None and job.proc.poll() is not None:
            job._communicate(None)
            raise AssertionError(
                f"launch exited before writing {[str(p) for p in paths if not p.exists()]}.\n"
                + _describe(job.args, job.proc.returncode, job.elapsed, job._stdout,
                            job._stderr))
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise AssertionError(f"timed out after {timeout:g} s waiting for {missing}")
        time.sleep(0.05)


def _kill_marked(token: str) -> list[int]:
    pids = marked_processes(token)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class LaunchProcess:
    """A running `tfdp-launch`, for tests that interact with it.

    Use `start_launch(...)` as a context manager; leaving the block kills and
    reaps everything the launch started, whatever happened inside.

    Attributes:
        args: the launcher's argv.
        proc: its `subprocess.Popen` (own session: signal it with
            `send_signal`).
        token: this run's `TOKEN_VAR` value.
    """

    def __init__(self, args: list[str], *, env: dict[str, str], cwd, token: str):
        self.args = args
        self.token = token
        self._start = time.monotonic()
        self.proc = subprocess.Popen(
            args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True,
        )
        self._stdout = ""
        self._stderr = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the launcher (it forwards SIGINT/SIGTERM)."""
        if self.proc.returncode is None:
            self.proc.send_signal(signum)

    def _communicate(self, timeout: float | None) -> None:
        out, err = self.proc.communicate(timeout=timeout)
        self._stdout += out or ""
        self._stderr += err or ""

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> LaunchResult:
        """Waits for the launch to end and returns its `LaunchResult`.

        Raises:
            LaunchTimeout: the launch ran longer than `timeout` seconds; it and
                every process it started were killed first.
            LaunchLeftovers: the launch exited but left processes running.
        """
        try:
            self._communicate(timeout)
        except subprocess.TimeoutExpired:
            killed = self.kill()
            raise LaunchTimeout(
                f"launch did not finish within {timeout:g} s; killed it (SIGTERM, "
                f"then SIGKILL) and {len(killed)} leftover process(es) {killed}.\n"
                + _describe(self.args, self.proc.returncode, self.elapsed,
                            self._stdout, self._stderr)
            ) from None
        result = LaunchResult(self.args, self.proc.returncode, self._stdout, self._stderr,
                              elapsed=self.elapsed)
        leftovers = _kill_marked(self.token)
        if leftovers:
            raise LaunchLeftovers(
                f"launch exited but processes it started were still running: "
                f"{leftovers} (now killed).\n" + result.describe(), result, leftovers
            )
        return result

    @property
    def elapsed(self) -> float:
        """Seconds since the launch started."""
        return time.monotonic() - self._start

    def kill(self) -> list[int]:
        """Stops the launch and everything it started; returns leftover pids.

        SIGTERM to the launcher (it stops its workers within its grace
        period), SIGKILL if it is still running `_STOP_MARGIN` seconds later,
        then SIGKILL to any process still carrying the run's marker. Always
        reaps the launcher.
        """
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self._communicate(_STOP_MARGIN + _grace_period(self.args))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._communicate(None)
        # The launcher SIGKILLs its workers' groups and its workers die with it
        # (PR_SET_PDEATHSIG), so this only finds something after a launcher bug.
        leftovers = _kill_marked(self.token)
        self.proc.wait()
        return leftovers

    def __enter__(self) -> "LaunchProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()


def _grace_period(args: Sequence[str]) -> float:
    if "--grace_period" in args:
        return float(args[args.index("--grace_period") + 1])
    return 5.0


def start_launch(
    command: Sequence[str],
    *,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    launch_args: Sequence[str] = (),
) -> LaunchProcess:
    """Starts `tfdp-launch --nproc_per_node nproc -- command`; returns at once.

    Args:
        command: what every worker runs.
        nproc: number of workers. Defaults to 2.
        env: extra environment variables for the launcher and its workers.
        cwd: working directory. Defaults to this process's.
        launch_args: extra launcher flags, e.g. `["--grace_period", "1"]`.

    Returns:
        A `LaunchProcess`; use it in a `with` block.
    """
    token = uuid.uuid4().hex
    return LaunchProcess(launch_command(command, nproc=nproc, launch_args=launch_args),
                         env=_environment(env, token), cwd=cwd, token=token)


def run_launch(
    command: Sequence[str],
    *,
    nproc: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    launch_args: Sequence[str] = (),
    check: bool = False,
) -> LaunchResult:
    """Runs `tfdp-launch --nproc_per_node nproc -- command` to completion.

    Args:
        command: what every worker runs, e.g. `python_command(script)`.
        nproc: number of workers. Defaults to 2.
        timeout: seconds before the launch is killed. Defaults to 120.
        env: extra environment variables for the launcher and its workers.
        cwd: working directory. Defaults to this process's.
        launch_args: extra launcher flags, e.g. `["--grace_period", "1"]`.
        check: raise `LaunchFailed` (with all output) on a non-zero exit.
            Defaults to False.

    Returns:
        A `LaunchResult` (`returncode`, prefixed `stdout`/`stderr`, `elapsed`,
        `worker_stdout(rank)`, ...).

    Raises:
        LaunchTimeout: after `timeout` seconds; nothing is left running.
        LaunchLeftovers: the launch left processes running (they are killed).
        LaunchFailed: `check` and a non-zero exit status.
    """
    with start_launch(command, nproc=nproc, env=env, cwd=cwd,
                      launch_args=launch_args) as job:
        result = job.wait(timeout)
    if check and result.returncode != 0:
        raise LaunchFailed("launch failed.\n" + result.describe(), result)
    return result


def write_worker_script(
    directory: str | os.PathLike, source: str, *, name: str = "worker.py"
) -> Path:
    """Writes `source` (dedented) to `directory/name` and returns the path."""
    path = Path(directory) / name
    path.write_text(textwrap.dedent(source).lstrip("\n"))
    return path


def run_worker_script(
    tmp_path: str | os.PathLike,
    source: str,
    *,
    nproc: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    script_args: Sequence[str] = (),
    launch_args: Sequence[str] = (),
    check: bool = False,
) -> LaunchResult:
    """Writes `source` to `tmp_path/worker.py` and runs it on `nproc` workers.

    The workers run `python -u worker.py *script_args` with `cwd=tmp_path`.
    See `run_launch` for the other arguments, the result and the errors.
    """
    script = write_worker_script(tmp_path, source)
    return run_launch(python_command(script, *script_args), nproc=nproc, timeout=timeout,
                      env=env, cwd=tmp_path, launch_args=launch_args, check=check)
