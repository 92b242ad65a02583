"""Restart a failed worker group, up to `--max_restarts` times.

This module owns the attempt loop of one node's launcher: run the workers as a
`WorkerGroup`; when one fails and restarts are left, the group is stopped
(SIGTERM, the grace period, SIGKILL, `wait()` for every process), the next
attempt is planned from scratch and a new group starts. When no restart is
left, the failing worker's last lines of stdout and of stderr are repeated on
the launcher's stderr, and the launcher exits with the worker's exit code. A signal to the launcher (SIGINT,
SIGTERM) stops the workers and never leads to a restart.

Port collisions. The launcher picks free ports, then the workers bind them: in
between, another process can take one (check-then-use). When an attempt fails
and the `port_collision` callable says a port was taken (the failing worker
exited with `PORT_IN_USE_EXIT_CODE`, or one of the ports is still held by
another process once every worker is stopped), the attempt is run again with
new ports, up to `MAX_PORT_RETRIES` times; that retry does not count as a
restart.

What a restart changes is not decided here: the `replan` callable builds the
next attempt (`tfdp.launch.local.restart_plan`: fresh environments with
`TFDP_RESTART_COUNT`, fresh free ports, or the same fixed ports once they are
free). Nothing of the dead workers' processes carries over. The training
program resumes on its own: `tfdp.Trainer` restores the latest checkpoint in
its `model_dir` when it starts.

Several nodes: each node's launcher restarts only its own workers, so give
every node the same `--max_restarts`. The others follow: a restarted worker
reconnects to the cluster with a new incarnation, TensorFlow's coordination
service then aborts the other workers' collectives ("... unexpectedly tried to
connect with a different incarnation. It has likely restarted."), they exit
with an error, and their launchers restart them too; all meet again at the
same `--hosts` addresses (`tests/launch/test_launch_main.py` runs this with two
nodes). A worker that dies and is *not* restarted is noticed by its peers only
through the coordination service's heartbeat or a collective timeout
(`tfdp.make_strategy(timeout_seconds=...)`).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from typing import BinaryIO, Callable, Mapping, Sequence, TypeVar

from tfdp.launch.output import LineSink
from tfdp.launch.signals import SignalCatcher
from tfdp.launch.worker_group import (
    DEFAULT_TAIL_LINES,
    GroupResult,
    WorkerGroup,
    describe_returncode,
)

Plan = TypeVar("Plan")

#: Times an attempt is re-run with new ports after a port collision.
MAX_PORT_RETRIES = 3


@dataclasses.dataclass(frozen=True)
class _Attempt:
    result: GroupResult | None  # None: the workers could not be started
    start_error: int | None
    tail: dict[str, list[bytes]]


def _run_attempt(plan, attempt: int, *, describe, signals: SignalCatcher, stdout, stderr,
                 tail_lines: int) -> _Attempt:
    with WorkerGroup(plan.workers, stdout=stdout, stderr=stderr,
                     tail_lines=tail_lines) as group:
        group.log(describe(plan, attempt))
        try:
            group.start()
        except OSError as e:
            group.log(f"could not start the workers: {e}")
            return _Attempt(None, 127 if isinstance(e, FileNotFoundError) else 126, {})
        result = group.supervise(grace_period=plan.grace_period, signals=signals)
    # After close(): the pumps drained every pipe, so the tail is complete.
    tail = group.output_tail(result.failure.rank) if result.failure is not None else {}
    return _Attempt(result, None, tail)


def _log_tail(log: Callable[[str], None], sink: LineSink, rank: int,
              tail: Mapping[str, Sequence[bytes]]) -> None:
    if not any(tail.values()):
        log(f"worker {rank} wrote no output")
        return
    for stream in ("stdout", "stderr"):  # stderr last: tracebacks end up next to the exit
        lines = tail.get(stream, ())
        if lines:
            log(f"last {len(lines)} line(s) of worker {rank}'s {stream}:")
            for line in lines:
                sink.write_line(b"[launch] | ", line)


def run_with_restarts(
    plan: Plan,
    *,
    describe: Callable[[Plan, int], str],
    replan: Callable[[Plan, int, Callable[[], bool]], Plan],
    warnings: Sequence[str] = (),
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    tail_lines: int = DEFAULT_TAIL_LINES,
    port_collision: Callable[[Plan, int], str | None] | None = None,
    max_port_retries: int = MAX_PORT_RETRIES,
) -> int:
    """Runs `plan`'s workers, restarting the whole group after a failure.

    Args:
        plan: has `workers` (the `WorkerSpec`s), `grace_period` (seconds) and
            `max_restarts` (>= 0), e.g. a `tfdp.launch.local.LocalLaunchPlan`.
        describe: `(plan, attempt) -> str`, the start-up line of an attempt
            (attempt 0 is the first run).
        replan: `(plan, restart_count, cancelled) -> plan` for the next
            attempt; `cancelled()` turns True when the launcher got a signal.
            May raise `OSError` or `ValueError`, which ends the launch.
        warnings: `[launch] ` lines logged once, before the first attempt.
        stdout: stream for the workers' prefixed stdout. Defaults to
            `sys.stdout.buffer`.
        stderr: stream for their stderr and the `[launch] ` messages.
            Defaults to `sys.stderr.buffer`.
        tail_lines: lines of the failing worker's stdout, and of its stderr,
            repeated at the end. Defaults to `DEFAULT_TAIL_LINES` (20).
        port_collision: `(plan, returncode) -> str | None`, called after a
            failed attempt (every worker stopped) with the failing worker's
            return code: a description when one of its ports was taken by
            another process and the attempt should run again with new ports
            (`replan` with the same restart count), else None.
            Defaults to None (no such retry).
        max_port_retries: port-collision retries over the whole launch.
            Defaults to `MAX_PORT_RETRIES`.

    Returns:
        0 when an attempt ends with every worker exiting 0; the failing
        worker's exit code (128 + signum if a signal killed it) once no
        restart is left or the next attempt cannot be planned; 128 + signum
        when the launcher received SIGINT (130) or SIGTERM (143); 126/127 if
        a worker could not be started (not retried: that is not transient).
    """
    stream = stderr if stderr is not None else sys.stderr.buffer
    sink = LineSink(stream)

    def log(message: str) -> None:
        sink.write_line(b"[launch] ", message.encode())

    def stop_for_signal(context: str) -> int:
        received = signals.first
        log(f"{context}; not restarting: received {signal.Signals(received).name}")
        log(f"exiting with code {128 + received} (stopped the workers after a signal)")
        return 128 + received

    total = plan.max_restarts + 1
    with SignalCatcher() as signals:
        for message in warnings:
            log(message)
        attempt = 0
        port_retries = 0
        while True:
            outcome = _run_attempt(plan, attempt, describe=describe, signals=signals,
                                   stdout=stdout, stderr=stream, tail_lines=tail_lines)
            if outcome.result is None:
                return outcome.start_error
            result = outcome.result
            if result.exit_code == 0:
                return 0
            if result.signal is not None:
                log(f"exiting with code {result.exit_code} (stopped the workers after a signal)")
                return result.exit_code
            failure = result.failure
            what = f"worker {failure.rank} {describe_returncode(failure.returncode)}"
            collision = None if port_collision is None else port_collision(
                plan, failure.returncode)
            if collision and port_retries < max_port_retries and signals.first is None:
                port_retries += 1
                log(f"{what}; {collision}: running the attempt again with new ports "
                    f"(port retry {port_retries} of {max_port_retries}, not a restart)")
                try:
                    plan = replan(plan, attempt, lambda: signals.count > 0)
                except (OSError, ValueError) as e:
                    log(f"cannot pick new ports: {e}")
                else:
                    if signals.first is not None:
                        return stop_for_signal(what)
                    continue
            if attempt + 1 < total:
                if signals.first is not None:
                    return stop_for_signal(what)
                log(f"{what}; restarting the group (attempt {attempt + 2} of {total})")
                try:
                    plan = replan(plan, attempt + 1, lambda: signals.count > 0)
                except (OSError, ValueError) as e:
                    if signals.first is not None:
                        return stop_for_signal(what)
                    log(f"cannot restart the group: {e}")
                else:
                    if signals.first is not None:
                        return stop_for_signal(what)
                    attempt += 1
                    continue
            elif total > 1:
                log(f"{what} in the last attempt ({total} of {total}); not restarting")
            _log_tail(log, sink, failure.rank, outcome.tail)
            log(f"exiting with code {failure.exit_code} (worker {failure.rank} failed)")
            return failure.exit_code
