"""Run N workers of one command on this host, as one multi-worker job.

This module owns the *local* launch: it validates the launch arguments, picks
one loopback port per worker, and gives each worker its environment (TF_CONFIG
plus the `TFDP_*` rank variables below). Starting, watching and stopping the
processes is `launch.worker_group`'s job; parsing flags is `launch.__main__`'s.

Every worker gets, on top of the launcher's environment:

- `TF_CONFIG`: `{"cluster": {"worker": ["127.0.0.1:P0", ...]},
  "task": {"type": "worker", "index": RANK}}`. Worker 0 is the chief
  (TensorFlow's rule when there is no "chief" task). It is set for N=1 too, so
  a script behaves the same with one worker as with several (a one-worker
  `MultiWorkerMirroredStrategy`). A TF_CONFIG already in the environment is
  replaced.
- `TFDP_RANK`: the worker's global rank, 0..WORLD_SIZE-1.
- `TFDP_LOCAL_RANK`: its rank on this host, 0..nproc_per_node-1 (equal to
  `TFDP_RANK` for a single-host launch).
- `TFDP_WORLD_SIZE`: total number of workers.
- `TFDP_LOCAL_WORLD_SIZE`: number of workers on this host.
- `PYTHONUNBUFFERED=1`, so Python workers' output arrives line by line.

Workers read stdin from /dev/null and inherit the launcher's working directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
from typing import Any, BinaryIO, Mapping, Sequence

from tfdp import cluster as cluster_lib

from launch.signals import SignalCatcher
from launch.worker_group import WorkerGroup, WorkerSpec

#: Default seconds between the polite signal (SIGTERM/SIGINT) and SIGKILL.
DEFAULT_GRACE_PERIOD = 5.0
#: Address every local worker listens on.
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalLaunchPlan:
    """A validated local launch, ready to run: one `WorkerSpec` per worker.

    Attributes:
        command: the command every worker runs.
        nproc_per_node: number of workers.
        ports: the port of each worker, by rank.
        grace_period: seconds between the polite signal and SIGKILL.
        workers: one spec per worker, rank order.
    """

    command: tuple[str, ...]
    nproc_per_node: int
    ports: tuple[int, ...]
    grace_period: float
    workers: tuple[WorkerSpec, ...]


def _echo(value: Any) -> str:
    return repr(value)


def _check_command(command: Sequence[str], path: str | None) -> tuple[str, ...]:
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(
            "`command` must be a list of strings (program, then arguments), e.g. "
            f"['python', 'train.py']. Received: command={_echo(command)}"
        )
    if not command:
        raise ValueError(
            "`command` must not be empty: give the program to run after `--`, e.g. "
            "`python -m launch --nproc_per_node 2 -- python train.py`. "
            f"Received: command={_echo(command)}"
        )
    if not all(isinstance(part, str) for part in command):
        raise TypeError(f"`command` must contain only strings. Received: command={_echo(command)}")
    program = command[0]
    if shutil.which(program, path=path) is None:
        where = "is not an executable file" if os.sep in program else "was not found on PATH"
        raise ValueError(
            f"`command[0]` must be an executable program; {program!r} {where}. "
            f"Check the spelling or give a full path. Received: command={_echo(list(command))}"
        )
    return tuple(command)


def _check_ports_free(ports: Sequence[int], host: str) -> None:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # Servers (gRPC included) set SO_REUSEADDR: do the same, so a port
            # in TIME_WAIT from a previous run counts as free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise ValueError(
                    f"`port` range {ports[0]}..{ports[-1]} must be free on {host}, but "
                    f"port {port} is in use ({e.strerror}). Choose another `port`, or "
                    f"omit it to pick free ports. Received: port={ports[0]}"
                ) from None


def plan_local(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    environ: Mapping[str, str] | None = None,
) -> LocalLaunchPlan:
    """Validates a local launch and builds every worker's command and environment.

    Nothing is started: every argument error surfaces here, in a second.

    Args:
        command: program and arguments every worker runs (no shell).
        nproc_per_node: number of workers to start. Must be >= 1.
        port: first port; worker `i` listens on `port + i`. All of them must be
            free on 127.0.0.1 and <= 65535. If `None`, picks free ports.
            Defaults to `None`.
        grace_period: seconds between the polite signal (SIGTERM, or the
            forwarded SIGINT/SIGTERM) and SIGKILL. Must be finite and >= 0.
            Defaults to `DEFAULT_GRACE_PERIOD` (5 s).
        environ: base environment of every worker. Defaults to `os.environ`.

    Returns:
        A `LocalLaunchPlan`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if `command` is empty or its program cannot be found,
            `nproc_per_node` < 1, `port` is out of range or in use, or
            `grace_period` is negative or not finite.
    """
    environ = dict(os.environ if environ is None else environ)
    command = _check_command(command, environ.get("PATH"))
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int):
        raise TypeError(
            f"`nproc_per_node` must be an int. Received: nproc_per_node={_echo(nproc_per_node)}"
        )
    if nproc_per_node < 1:
        raise ValueError(
            "`nproc_per_node` must be >= 1 (the number of worker processes to start). "
            f"Received: nproc_per_node={nproc_per_node}"
        )
    if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)):
        raise TypeError(
            "`grace_period` must be a number of seconds. "
            f"Received: grace_period={_echo(grace_period)}"
        )
    if not math.isfinite(grace_period) or grace_period < 0:
        raise ValueError(
            "`grace_period` must be a finite number of seconds >= 0. "
            f"Received: grace_period={grace_period}"
        )
    if port is None:
        ports = tuple(cluster_lib.free_ports(nproc_per_node, host=LOOPBACK))
    else:
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"`port` must be an int or None. Received: port={_echo(port)}")
        last = 65535 - (nproc_per_node - 1)
        if not 1 <= port <= last:
            raise ValueError(
                f"`port` must be in [1, {last}] so that the {nproc_per_node} worker "
                f"ports port..port+{nproc_per_node - 1} are all <= 65535. "
                f"Received: port={port}"
            )
        ports = tuple(range(port, port + nproc_per_node))
        _check_ports_free(ports, LOOPBACK)

    workers = []
    for rank in range(nproc_per_node):
        tf_config = cluster_lib.local_tf_config(nproc_per_node, rank, ports=ports, host=LOOPBACK)
        env = dict(environ)
        env.update(
            TF_CONFIG=json.dumps(tf_config),
            TFDP_RANK=str(rank),
            TFDP_LOCAL_RANK=str(rank),
            TFDP_WORLD_SIZE=str(nproc_per_node),
            TFDP_LOCAL_WORLD_SIZE=str(nproc_per_node),
            PYTHONUNBUFFERED="1",
        )
        workers.append(WorkerSpec(rank=rank, command=command, env=env))
    return LocalLaunchPlan(
        command=command,
        nproc_per_node=nproc_per_node,
        ports=ports,
        grace_period=float(grace_period),
        workers=tuple(workers),
    )


def run_plan(
    plan: LocalLaunchPlan,
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Runs a planned local launch to completion and returns its exit code.

    While it runs (when called from the main thread), SIGINT and SIGTERM are
    forwarded to the workers instead of ending this process.

    Args:
        plan: from `plan_local`.
        stdout: binary stream for the workers' prefixed stdout. Defaults to
            `sys.stdout.buffer`.
        stderr: binary stream for the workers' prefixed stderr and `[launch] `
            messages. Defaults to `sys.stderr.buffer`.

    Returns:
        0 if every worker exited 0; else the exit code of the first worker that
        failed (128 + signum if a signal killed it); 128 + signum if this
        process received SIGINT (130) or SIGTERM (143); 126/127 if a worker
        could not be started.
    """
    with SignalCatcher() as signals, WorkerGroup(plan.workers, stdout=stdout,
                                                 stderr=stderr) as group:
        group.log(
            f"starting {plan.nproc_per_node} worker(s) on {LOOPBACK} ports "
            f"{','.join(map(str, plan.ports))}: {' '.join(plan.command)}"
        )
        try:
            group.start()
        except OSError as e:
            group.log(f"could not start the workers: {e}")
            return 127 if isinstance(e, FileNotFoundError) else 126
        result = group.supervise(grace_period=plan.grace_period, signals=signals)
        if result.exit_code != 0:
            if result.signal is not None:
                reason = "stopped the workers after a signal"
            else:
                reason = f"worker {result.failure.rank} failed"
            group.log(f"exiting with code {result.exit_code} ({reason})")
        return result.exit_code


def run_local(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    environ: Mapping[str, str] | None = None,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Runs `command` as `nproc_per_node` local workers; returns the exit code.

    `plan_local` then `run_plan`: see those for the arguments, the errors
    raised before anything starts, and the exit codes.

    Example:

    >>> run_local(["python", "train.py"], nproc_per_node=2)
    0
    """
    plan = plan_local(command, nproc_per_node=nproc_per_node, port=port,
                      grace_period=grace_period, environ=environ)
    return run_plan(plan, stdout=stdout, stderr=stderr)
