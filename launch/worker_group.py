"""Start, watch and stop a group of worker processes as one unit.

This module owns the life cycle of a set of worker processes: start them (each
in its own session and process group, so signals reach its children too),
copy their output with rank prefixes, notice the first one that fails, stop
the rest (forward a signal, wait a grace period, then SIGKILL the whole
process group) and `wait()` for every one of them, always. It does not decide
what the workers run or how they find each other (TF_CONFIG, ranks: see
`tfdp.launch.local`) and does not parse flags (`tfdp.launch.__main__`).

A `WorkerGroup` is one attempt of one node's workers: restarting the group
(`--max_restarts`, `tfdp.launch.restarts`) means closing it and starting a new one
from fresh specs, so nothing of a dead worker's process state carries over.
Each worker's last lines of output are kept (`output_tail`) for the failure
report.

Exit codes. `WorkerExit.exit_code` is the worker's exit status, or
`128 + signum` if a signal killed it (the shell's convention: SIGKILL -> 137,
SIGTERM -> 143). `GroupResult.exit_code` is 0 when every worker exited 0; the
`exit_code` of the first worker seen to fail otherwise; and `128 + signum`
when the launcher itself received SIGINT/SIGTERM (130/143) and stopped the
group, whatever the workers' own statuses.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import subprocess
import sys
import time
from typing import BinaryIO, Callable, Mapping, Sequence

from tfdp.launch import _proc
from tfdp.launch.output import LineSink, PrefixPump
from tfdp.launch.signals import SignalCatcher

#: How often the supervisor polls worker state, in seconds.
POLL_INTERVAL = 0.05
#: How long to wait for a pump thread to drain a pipe after its worker exited.
_PUMP_JOIN_TIMEOUT = 2.0
#: Lines of each worker's output kept for `WorkerGroup.output_tail`.
DEFAULT_TAIL_LINES = 20


def exit_code_of(returncode: int) -> int:
    """Maps a `Popen.returncode` to a shell exit code (`-signum` -> 128+signum)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_returncode(returncode: int) -> str:
    """Human-readable form of a `Popen.returncode`, e.g. "killed by SIGKILL"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code_of(returncode)})"
    return f"exited with code {returncode}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What to run as one worker.

    Attributes:
        rank: the worker's global rank; it labels the output (`[rank] `).
        command: program and arguments (no shell).
        env: the worker's complete environment.
        cwd: working directory, or `None` for the launcher's. Defaults to None.
    """

    rank: int
    command: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None = None

    @property
    def prefix(self) -> bytes:
        """The prefix of this worker's output lines, e.g. `b"[0] "`."""
        return f"[{self.rank}] ".encode()


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How one worker ended.

    Attributes:
        rank: the worker's rank.
        pid: its process id (already reaped).
        returncode: `Popen.returncode`: the exit status, or `-signum`.
    """

    rank: int
    pid: int
    returncode: int

    @property
    def exit_code(self) -> int:
        """The exit status, or `128 + signum` if a signal killed the worker."""
        return exit_code_of(self.returncode)


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """How a worker group ended (see the module docstring for exit codes).

    Attributes:
        exit_code: what the launcher should exit with.
        exits: every worker's exit, in the order the supervisor saw them.
        failure: the first worker seen to exit non-zero, or `None`.
        signal: the signal the launcher received and forwarded, or `None`.
    """

    exit_code: int
    exits: tuple[WorkerExit, ...]
    failure: WorkerExit | None
    signal: int | None


class _Worker:
    """A started worker: its spec, process and output pumps."""

    def __init__(self, spec: WorkerSpec, proc: subprocess.Popen, tail_lines: int):
        self.spec = spec
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the worker leads its group
        self.pumps: list[PrefixPump] = []
        # The last lines of each stream (kept apart: the two pumps run
        # independently, so their relative order is not reliable).
        self.tails = {name: collections.deque(maxlen=tail_lines)
                      for name in ("stdout", "stderr")}
        self.exit: WorkerExit | None = None  # set once the exit is recorded


class WorkerGroup:
    """A set of worker processes started, supervised and stopped together.

    Use it as a context manager: leaving the block stops whatever still runs
    (SIGKILL to every worker's process group) and waits for every process, so
    no worker outlives the group even when an exception is raised.

    Args:
        specs: one `WorkerSpec` per worker; ranks must be distinct.
        stdout: binary stream receiving prefixed worker stdout. Defaults to
            `sys.stdout.buffer`.
        stderr: binary stream receiving prefixed worker stderr and the
            launcher's own `[launch] ` messages. Defaults to `sys.stderr.buffer`.
        tail_lines: how many of each worker's last stdout lines, and of its
            last stderr lines, `output_tail` keeps. Defaults to
            `DEFAULT_TAIL_LINES` (20).

    Raises:
        ValueError: if `specs` is empty or two specs share a rank.

    Example:

    >>> with WorkerGroup(specs) as group:
    ...     group.start()
    ...     result = group.supervise(grace_period=5.0)
    >>> result.exit_code
    0
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        tail_lines: int = DEFAULT_TAIL_LINES,
    ):
        specs = tuple(specs)
        if not specs:
            raise ValueError("`specs` must contain at least one WorkerSpec. Received: specs=()")
        ranks = [spec.rank for spec in specs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"`specs` must have distinct ranks. Received ranks: {ranks}")
        self._specs = specs
        self._tail_lines = tail_lines
        self._stdout = LineSink(stdout if stdout is not None else sys.stdout.buffer)
        self._stderr = LineSink(stderr if stderr is not None else sys.stderr.buffer)
        self._workers: list[_Worker] = []
        self._exits: list[WorkerExit] = []

    # -- life cycle ---------------------------------------------------------

    def start(self) -> None:
        """Starts every worker, then the threads copying their output.

        Each worker gets its own session (so it has its own process group, and
        Ctrl-C in a terminal reaches only the launcher, which forwards it),
        stdin from /dev/null, and, on Linux, SIGKILL if the launcher dies.

        Raises:
            RuntimeError: if the group was already started.
            OSError: if a worker cannot be started; workers already started
                are left for `close()` to stop.
        """
        if self._workers:
            raise RuntimeError("WorkerGroup.start() was already called; start a new group.")
        for spec in self._specs:
            proc = subprocess.Popen(
                list(spec.command),
                env=dict(spec.env),
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_proc.parent_death_signal_hook(),
            )
            self._workers.append(_Worker(spec, proc, self._tail_lines))
        # Pumps start after every fork: `preexec_fn` is only safe while this
        # process has no other threads.
        for worker in self._workers:
            for name, pipe, sink in (("stdout", worker.proc.stdout, self._stdout),
                                     ("stderr", worker.proc.stderr, self._stderr)):
                pump = PrefixPump(pipe, sink, worker.spec.prefix, tail=worker.tails[name])
                pump.start()
                worker.pumps.append(pump)

    def log(self, message: str) -> None:
        """Writes a `[launch] ` message to the group's stderr stream."""
        self._stderr.write_line(b"[launch] ", message.encode())

    @property
    def pids(self) -> dict[int, int]:
        """Rank -> pid of every started worker."""
        return {w.spec.rank: w.proc.pid for w in self._workers}

    @property
    def exits(self) -> tuple[WorkerExit, ...]:
        """Workers that exited so far, in the order they were seen."""
        return tuple(self._exits)

    def output_tail(self, rank: int) -> dict[str, list[bytes]]:
        """The last lines worker `rank` wrote: `{"stdout": [...], "stderr": [...]}`.

        Complete only once the worker's pipes are drained: after `close()`.

        Raises:
            KeyError: if no worker of this group has rank `rank`.
        """
        for worker in self._workers:
            if worker.spec.rank == rank:
                return {name: list(tail) for name, tail in worker.tails.items()}
        raise KeyError(f"no started worker has rank {rank}; ranks: {sorted(self.pids)}")

    def running(self) -> list[int]:
        """Ranks of the workers that have not exited (as of the last `poll`)."""
        return [w.spec.rank for w in self._workers if w.exit is None]

    def poll(self) -> list[WorkerExit]:
        """Reaps workers that exited since the last call and returns them."""
        new = []
        for worker in self._workers:
            if worker.exit is None and self._reap(worker, block=False):
                new.append(worker.exit)
        return new

    def _reap(self, worker: _Worker, *, block: bool) -> bool:
        """Reaps `worker` (waiting if `block`); records its exit. True if it exited."""
        returncode = worker.proc.wait() if block else worker.proc.poll()
        if returncode is None:
            return False
        if worker.exit is None:
            worker.exit = WorkerExit(worker.spec.rank, worker.proc.pid, returncode)
            self._exits.append(worker.exit)
        return True

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the process group of every running worker."""
        for worker in self._workers:
            if worker.exit is None:
                _proc.signal_group(worker.pgid, signum)

    def stop(
        self,
        *,
        grace_period: float,
        signum: int = signal.SIGTERM,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        """Stops every running worker and waits for all of them.

        Sends `signum` to each running worker's process group, waits up to
        `grace_period` seconds for them to exit, then SIGKILLs the groups of
        those still running (TensorFlow's multi-worker strategies install a
        SIGTERM handler, so their workers usually need the SIGKILL).

        Args:
            grace_period: seconds between `signum` and SIGKILL.
            signum: the first signal. Defaults to SIGTERM.
            hurry: polled while waiting; when it returns True, SIGKILL at once
                (e.g. the user pressed Ctrl-C a second time).
        """
        self.poll()
        if not self.running():
            return
        self.send_signal(signum)
        deadline = time.monotonic() + grace_period
        while self.running() and time.monotonic() < deadline and not hurry():
            time.sleep(POLL_INTERVAL)
            self.poll()
        if self.running():
            for worker in self._workers:
                if worker.exit is None:
                    self.log(f"worker {worker.spec.rank} (pid {worker.proc.pid}) still "
                             f"running {grace_period:g} s after {signal.Signals(signum).name}; "
                             "sending SIGKILL")
            self.send_signal(signal.SIGKILL)
        for worker in self._workers:
            self._reap(worker, block=True)

    def close(self) -> None:
        """SIGKILLs whatever is left in the workers' groups and reaps the workers.

        Safe to call more than once and on a group that failed to start. Also
        kills processes a worker left behind in its process group, so nothing
        the group started keeps running (or holds a port) after it.
        """
        for worker in self._workers:
            _proc.signal_group(worker.pgid, signal.SIGKILL)
        for worker in self._workers:
            self._reap(worker, block=True)
        for worker in self._workers:
            for pump in worker.pumps:
                pump.join(timeout=_PUMP_JOIN_TIMEOUT)
            # Close a pipe only once no pump reads it: closing a buffered
            # reader another thread is blocked in can deadlock. A pump still
            # blocked here means a process outside the worker's group holds the
            # pipe; the daemon thread is abandoned.
            pumps = worker.pumps or [None, None]  # `start` failed before the pumps
            for pump, pipe in zip(pumps, (worker.proc.stdout, worker.proc.stderr)):
                if (pump is None or not pump.is_alive()) and pipe is not None:
                    pipe.close()

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- supervision --------------------------------------------------------

    def supervise(
        self, *, grace_period: float, signals: SignalCatcher | None = None
    ) -> GroupResult:
        """Waits until every worker exits 0, one fails, or a signal arrives.

        Fail-fast: when a worker exits non-zero (or is killed), the others get
        SIGTERM, then SIGKILL after `grace_period`. When `signals` records a
        signal, it is forwarded to every worker's process group, with SIGKILL
        after `grace_period` (or at once on a second signal).

        Args:
            grace_period: seconds between the polite signal and SIGKILL.
            signals: an entered `SignalCatcher`, or `None` to not watch for
                signals. Defaults to None.

        Returns:
            A `GroupResult`; every worker has exited and been reaped.
        """
        while True:
            received = signals.first if signals is not None else None
            if received is not None:
                failure = self._failure()  # a failure before the signal, if any
                self.log(f"received {signal.Signals(received).name}; forwarding it to "
                         f"{len(self.running())} running worker(s), SIGKILL after "
                         f"{grace_period:g} s")
                self.stop(grace_period=grace_period, signum=received,
                          hurry=lambda: signals.count > 1)
                return GroupResult(128 + received, self.exits, failure, received)
            self.poll()
            failure = self._failure()
            if failure is not None:
                others = self.running()
                self.log(f"worker {failure.rank} (pid {failure.pid}) "
                         f"{describe_returncode(failure.returncode)}; stopping "
                         f"{len(others)} other running worker(s): SIGTERM, SIGKILL after "
                         f"{grace_period:g} s")
                self.stop(grace_period=grace_period,
                          hurry=lambda: signals is not None and signals.count > 0)
                return GroupResult(failure.exit_code, self.exits, failure, None)
            if not self.running():
                return GroupResult(0, self.exits, None, None)
            time.sleep(POLL_INTERVAL)

    def _failure(self) -> WorkerExit | None:
        for worker_exit in self._exits:
            if worker_exit.returncode != 0:
                return worker_exit
        return None
