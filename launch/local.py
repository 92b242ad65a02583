"""Run this node's workers of one multi-worker job.

This module owns what each worker runs, with which environment: it validates
the launch arguments, picks or checks the workers' ports, and gives each
worker its TF_CONFIG and `TFDP_*` variables. Two launches share it:

- one host (`plan_local`): N workers on 127.0.0.1;
- one node of several (`plan_nodes`): this node's N of the M x N workers laid
  out by `--hosts` (see `tfdp.launch.nodes` for the layout rule and for how
  TensorFlow binds its ports).

Starting, watching and stopping the processes is `tfdp.launch.worker_group`'s job,
restarting them `tfdp.launch.restarts`', parsing flags `tfdp.launch.__main__`'s.

Every worker gets, on top of the launcher's environment:

- `TF_CONFIG`: `{"cluster": {"worker": [ADDRESS_0, ADDRESS_1, ...]},
  "task": {"type": "worker", "index": RANK}}`, every worker of the job in
  global-rank order (`127.0.0.1:PORT` on one host). Worker 0 is the chief
  (TensorFlow's rule when there is no "chief" task). It is set for N=1 too, so
  a script behaves the same with one worker as with several (a one-worker
  `MultiWorkerMirroredStrategy`). A TF_CONFIG already in the environment is
  replaced.
- `TFDP_RANK`: the worker's global rank, 0..WORLD_SIZE-1.
- `TFDP_LOCAL_RANK`: its rank on this node, 0..nproc_per_node-1.
- `TFDP_WORLD_SIZE`: total number of workers (nnodes x nproc_per_node).
- `TFDP_LOCAL_WORLD_SIZE`: number of workers on this node.
- `TFDP_NODE_RANK`: this node's rank (0 on one host).
- `TFDP_RESTART_COUNT`: 0 for the first attempt, then 1, 2, ... for each
  restart of the group (`--max_restarts`).
- `PYTHONUNBUFFERED=1`, so Python workers' output arrives line by line.
- On a node with GPUs: `CUDA_VISIBLE_DEVICES`, the worker's own share of the
  node's GPUs (`tfdp.launch.gpus`: worker i of N gets GPUs `[i*G/N,
  (i+1)*G/N)` of the launcher's `CUDA_VISIBLE_DEVICES`, or of the G GPUs
  `nvidia-smi -L` lists; `--gpus_per_proc K` gives K each). Without GPUs
  nothing is set.
- Unless `--bind_all`: `LD_PRELOAD` (the `tfdp.launch.bind` shim, before any
  inherited `LD_PRELOAD`) and `TFDP_BIND_ADDRESS` (this node's IPv4 address,
  127.0.0.1 on one host), so TensorFlow's gRPC server, which binds all
  interfaces, listens on that address only. Without a C compiler to build the
  shim, these are not set and a warning says the workers listen on all
  interfaces.

Workers read stdin from /dev/null and inherit the launcher's working directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from typing import Any, BinaryIO, Callable, Mapping, Sequence

from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import local_cluster

from tfdp.launch import _checks
from tfdp.launch import bind as bind_lib
from tfdp.launch import gpus as gpus_lib
from tfdp.launch import nodes as nodes_lib
from tfdp.launch import restarts
from tfdp.launch.worker_group import WorkerSpec

#: Default seconds between the polite signal (SIGTERM/SIGINT) and SIGKILL.
DEFAULT_GRACE_PERIOD = 5.0
#: Address every worker of a one-host launch is reached at.
LOOPBACK = "127.0.0.1"
#: Seconds a restart waits for fixed ports to become free again.
PORT_WAIT_SECONDS = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalLaunchPlan:
    """A validated launch of this node's workers, ready to run.

    Attributes:
        command: the command every worker runs.
        nproc_per_node: number of workers on this node.
        ports: this node's worker ports, by local rank.
        grace_period: seconds between the polite signal and SIGKILL.
        workers: one spec per worker of this node, local-rank order.
        max_restarts: how many times the group may be restarted after a
            worker fails. Defaults to 0.
        fixed_ports: whether a restart reuses `ports` (`--port`, `--hosts`)
            or picks fresh free ones. Defaults to True.
        nnodes: number of nodes in the job. Defaults to 1.
        node_rank: this node's rank. Defaults to 0.
        host: the address this node's workers are reached at. Defaults to
            `LOOPBACK`.
        addresses: every worker's `host:port` in global-rank order; empty
            means `host:port` for each of `ports`. Defaults to ().
        bind_all: whether `--bind_all` was given (a warning is logged).
            Defaults to False.
        exposed: `--hosts` entries other machines can reach, accepted with
            `--bind_all`; the warning names them. Defaults to ().
        bind_warning: why the workers listen on all interfaces although
            `--bind_all` was not given (the bind shim could not be used);
            logged as a warning. Defaults to "".
        gpus: each local worker's GPUs (logged once), or None when no
            GPU is assigned. Defaults to None.
        gpu_warning: why this node's GPUs could not be read, logged as a
            warning. Defaults to "".
    """

    command: tuple[str, ...]
    nproc_per_node: int
    ports: tuple[int, ...]
    grace_period: float
    workers: tuple[WorkerSpec, ...]
    max_restarts: int = 0
    fixed_ports: bool = True
    nnodes: int = 1
    node_rank: int = 0
    host: str = LOOPBACK
    addresses: tuple[str, ...] = ()
    bind_all: bool = False
    exposed: tuple[str, ...] = ()
    bind_warning: str = ""
    gpus: gpus_lib.GpuAssignment | None = None
    gpu_warning: str = ""

    @property
    def world_size(self) -> int:
        """Number of workers in the whole job."""
        return self.nnodes * self.nproc_per_node

    def describe(self, attempt: int = 0) -> str:
        """The start-up line, e.g. `starting 2 worker(s) on 127.0.0.1 ports ...`."""
        text = (f"starting {self.nproc_per_node} worker(s) on {self.host} ports "
                f"{','.join(map(str, self.ports))}")
        if self.nnodes > 1:
            first = self.node_rank * self.nproc_per_node
            text += (f" (node {self.node_rank} of {self.nnodes}: ranks {first}.."
                     f"{first + self.nproc_per_node - 1} of {self.world_size})")
        if self.max_restarts:
            text += f" (attempt {attempt + 1} of {self.max_restarts + 1})"
        return f"{text}: {' '.join(self.command)}"




def _check_command(command: Sequence[str], path: str | None) -> tuple[str, ...]:
    command = _checks.check_command(
        command, example="tfdp-launch --nproc_per_node 2 -- python train.py")
    program = command[0]
    if shutil.which(program, path=path) is None:
        where = "is not an executable file" if os.sep in program else "was not found on PATH"
        raise ValueError(
            f"`command[0]` must be an executable program; {program!r} {where}. "
            f"Check the spelling or give a full path. Received: command={_checks.echo(list(command))}"
        )
    return tuple(command)


def _check_nproc(nproc_per_node: Any) -> None:
    _checks.check_int("nproc_per_node", nproc_per_node, minimum=1,
                      hint=" (the number of worker processes to start)")


def _check_grace_period(grace_period: Any) -> None:
    if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)):
        raise TypeError(
            "`grace_period` must be a number of seconds. "
            f"Received: grace_period={_checks.echo(grace_period)}"
        )
    if not math.isfinite(grace_period) or grace_period < 0:
        raise ValueError(
            "`grace_period` must be a finite number of seconds >= 0. "
            f"Received: grace_period={grace_period}"
        )


def _check_max_restarts(max_restarts: Any) -> None:
    _checks.check_int("max_restarts", max_restarts, minimum=0,
                      hint=" (how many times a failed group is restarted; 0 stops at the "
                           "first failure)")


# Binds where TensorFlow will (all interfaces), as gRPC does; shared with
# `tfdp.distribute.startup`, which checks again inside each worker.
port_in_use = local_cluster.port_in_use


def _check_ports_free(ports: Sequence[int], *, where: str, fix: str) -> None:
    for port in ports:
        reason = port_in_use(port)
        if reason is not None:
            raise ValueError(
                f"{where} ports {ports[0]}..{ports[-1]} must be free on this machine, but "
                f"port {port} is in use ({reason}). {fix}"
            )


def _bind_environment(host: str, environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The bind shim's variables for workers reached at `host`, or ({}, a warning)."""
    address = bind_lib.shim_address(host)
    if address is None:
        return {}, (f"warning: workers will listen on all interfaces: the bind shim "
                    f"(launch/bindshim.c) binds IPv4 addresses only, and {host!r} has none.")
    build = bind_lib.build_shim()
    if build.path is None:
        return {}, ("warning: workers will listen on all interfaces: the bind shim "
                    f"(launch/bindshim.c) could not be built: {build.error}.")
    return bind_lib.worker_environment(address, ld_preload=environ.get("LD_PRELOAD", "")), ""


def _worker_specs(
    command: tuple[str, ...],
    environ: Mapping[str, str],
    *,
    addresses: Sequence[str],
    nproc_per_node: int,
    node_rank: int,
    restart_count: int,
    bind_env: Mapping[str, str] = {},
    gpus: gpus_lib.GpuAssignment | None = None,
) -> tuple[WorkerSpec, ...]:
    world_size = len(addresses)
    specs = []
    for local_rank in range(nproc_per_node):
        rank = node_rank * nproc_per_node + local_rank
        # tfdp.distribute.cluster validates the cluster (addresses, index) once more.
        tf_config = cluster_lib.ClusterConfig(
            cluster={"worker": list(addresses)}, task_type="worker", task_index=rank)
        env = dict(environ)
        env.update(
            TF_CONFIG=tf_config.to_json(),
            TFDP_RANK=str(rank),
            TFDP_LOCAL_RANK=str(local_rank),
            TFDP_WORLD_SIZE=str(world_size),
            TFDP_LOCAL_WORLD_SIZE=str(nproc_per_node),
            TFDP_NODE_RANK=str(node_rank),
            TFDP_RESTART_COUNT=str(restart_count),
            PYTHONUNBUFFERED="1",
        )
        env.update(bind_env)
        if gpus is not None:
            env.update(gpus.environment(local_rank, environ))
        specs.append(WorkerSpec(rank=rank, command=command, env=env))
    return tuple(specs)


def plan_local(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    environ: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    gpus_per_proc: int | None = None,
) -> LocalLaunchPlan:
    """Validates a one-host launch and builds every worker's command and environment.

    Nothing is started: every argument error surfaces here, in a second.

    Args:
        command: program and arguments every worker runs (no shell).
        nproc_per_node: number of workers to start. Must be >= 1.
        port: first port; worker `i` listens on `port + i`. All of them must be
            free on this machine and <= 65535. If `None`, picks free ports
            (fresh ones on each restart). Defaults to `None`.
        grace_period: seconds between the polite signal (SIGTERM, or the
            forwarded SIGINT/SIGTERM) and SIGKILL. Must be finite and >= 0.
            Defaults to `DEFAULT_GRACE_PERIOD` (5 s).
        environ: base environment of every worker. Defaults to `os.environ`.
        max_restarts: times the whole group is restarted after a worker
            fails (see `tfdp.launch.restarts`). Must be >= 0. Defaults to 0.
        gpus_per_proc: GPUs each worker gets (`CUDA_VISIBLE_DEVICES`), or
            None to split this node's GPUs evenly (see `tfdp.launch.gpus`).
            Defaults to None.

    Returns:
        A `LocalLaunchPlan`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if `command` is empty or its program cannot be found,
            `nproc_per_node` < 1, `port` is out of range or in use,
            `grace_period` is negative or not finite, `max_restarts` < 0, or
            the node's GPUs cannot be split as asked.
    """
    environ = dict(os.environ if environ is None else environ)
    command = _check_command(command, environ.get("PATH"))
    _check_nproc(nproc_per_node)
    _check_grace_period(grace_period)
    _check_max_restarts(max_restarts)
    gpus, gpu_warning = gpus_lib.assign(environ, nproc_per_node=nproc_per_node,
                                        gpus_per_proc=gpus_per_proc)
    if port is None:
        ports = tuple(local_cluster.free_ports(nproc_per_node,
                                             host=nodes_lib.TENSORFLOW_LISTEN_ADDRESS))
    else:
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"`port` must be an int or None. Received: port={_checks.echo(port)}")
        last = 65535 - (nproc_per_node - 1)
        if not 1 <= port <= last:
            raise ValueError(
                f"`port` must be in [1, {last}] so that the {nproc_per_node} worker "
                f"ports port..port+{nproc_per_node - 1} are all <= 65535. "
                f"Received: port={port}"
            )
        ports = tuple(range(port, port + nproc_per_node))
        _check_ports_free(ports, where="`port`", fix=(
            f"Choose another `port`, or omit it to pick free ports. Received: port={port}"))
    addresses = tuple(f"{LOOPBACK}:{p}" for p in ports)
    bind_env, bind_warning = _bind_environment(LOOPBACK, environ)
    return LocalLaunchPlan(
        command=command,
        nproc_per_node=nproc_per_node,
        ports=ports,
        grace_period=float(grace_period),
        workers=_worker_specs(command, environ, addresses=addresses,
                              nproc_per_node=nproc_per_node, node_rank=0, restart_count=0,
                              bind_env=bind_env, gpus=gpus),
        max_restarts=max_restarts,
        fixed_ports=port is not None,
        addresses=addresses,
        bind_warning=bind_warning,
        gpus=gpus,
        gpu_warning=gpu_warning,
    )


def plan_nodes(
    command: Sequence[str],
    *,
    nnodes: int,
    node_rank: int,
    hosts: str | Sequence[str],
    nproc_per_node: int,
    bind_all: bool = False,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    environ: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    gpus_per_proc: int | None = None,
) -> LocalLaunchPlan:
    """Validates this node's part of a multi-node launch and builds its workers.

    Every node runs the same launch with its own `node_rank`; the layout
    (addresses, ranks) is `tfdp.launch.nodes`'. Nothing is started.

    Args:
        command: program and arguments every worker runs (no shell).
        nnodes: number of nodes. Must be >= 1 and equal to the entries of
            `hosts`.
        node_rank: this node's rank, in [0, nnodes).
        hosts: `"h0:p0,h1:p1,..."` (or a list of `"host:port"`): node `r`'s
            address and first port; its worker `i` listens on port `p_r + i`.
        nproc_per_node: workers per node. Must be >= 1.
        bind_all: accept addresses other machines can reach (TensorFlow's
            gRPC endpoints are unauthenticated; see `tfdp.launch.nodes`). Without
            it, only loopback addresses are accepted. Defaults to False.
        grace_period: see `plan_local`.
        environ: base environment of every worker. Defaults to `os.environ`.
        max_restarts: see `plan_local`; a restart reuses the same ports.
        gpus_per_proc: see `plan_local`; each node splits its own GPUs.

    Returns:
        A `LocalLaunchPlan` for this node's workers.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: for the `plan_local` errors, and if `hosts` is malformed,
            has not `nnodes` entries, gives two workers the same address, has
            an unresolvable host or (without `bind_all`) a non-loopback one;
            `node_rank` is out of range or names an entry whose address is
            not this machine's; or this node's ports are in use.
    """
    environ = dict(os.environ if environ is None else environ)
    command = _check_command(command, environ.get("PATH"))
    _check_nproc(nproc_per_node)
    _check_grace_period(grace_period)
    _check_max_restarts(max_restarts)
    if not isinstance(bind_all, bool):
        raise TypeError(f"`bind_all` must be a bool. Received: bind_all={_checks.echo(bind_all)}")
    gpus, gpu_warning = gpus_lib.assign(environ, nproc_per_node=nproc_per_node,
                                        gpus_per_proc=gpus_per_proc)
    layout = nodes_lib.plan_layout(hosts, nnodes=nnodes, node_rank=node_rank,
                                   nproc_per_node=nproc_per_node)
    exposed = nodes_lib.check_hosts(layout, bind_all=bind_all)
    _check_ports_free(layout.ports, where=f"`hosts` entry {node_rank} ({layout.this_node}):",
                      fix=f"Give node {node_rank} another first port in `hosts`. "
                          f"Received: hosts={_checks.echo(','.join(map(str, layout.hosts)))}")
    # Without --bind_all the workers listen on this node's --hosts address only.
    bind_env, bind_warning = ({}, "") if bind_all else _bind_environment(
        layout.this_node.host, environ)
    return LocalLaunchPlan(
        command=command,
        nproc_per_node=nproc_per_node,
        ports=layout.ports,
        grace_period=float(grace_period),
        workers=_worker_specs(command, environ, addresses=layout.addresses,
                              nproc_per_node=nproc_per_node, node_rank=node_rank,
                              restart_count=0, bind_env=bind_env, gpus=gpus),
        max_restarts=max_restarts,
        fixed_ports=True,
        nnodes=nnodes,
        node_rank=node_rank,
        host=layout.this_node.host,
        addresses=layout.addresses,
        bind_all=bind_all,
        exposed=tuple(exposed),
        bind_warning=bind_warning,
        gpus=gpus,
        gpu_warning=gpu_warning,
    )


def _wait_for_free_ports(ports: Sequence[int], *, timeout: float,
                         cancelled: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        busy = [(p, reason) for p in ports if (reason := port_in_use(p)) is not None]
        if not busy:
            return
        if time.monotonic() >= deadline or cancelled():
            port, reason = busy[0]
            raise OSError(
                f"port {port} is still in use ({reason}) {timeout:g} s after the workers "
                "were stopped; another process holds it. Free it, or restart without a "
                "fixed `port`."
            )
        time.sleep(0.1)


def port_collision(plan: LocalLaunchPlan, returncode: int) -> str | None:
    """After a failed attempt of `plan` (every worker stopped): a port another process took.

    Only free ports the launcher picked itself count (not `--port` or
    `--hosts` ones, which the user chose). A port counts as taken when the
    failing worker exited with `PORT_IN_USE_EXIT_CODE` (tfdp's programs do
    when their own port is taken at start-up: the other process may be gone
    by now, e.g. a short-lived connection), or when one of the ports is still
    held now that the workers are gone.

    Args:
        plan: the attempt that failed.
        returncode: the failing worker's return code (negative: a signal).

    Returns:
        A description of the collision, or None.
    """
    if plan.fixed_ports:
        return None
    if returncode == local_cluster.PORT_IN_USE_EXIT_CODE:
        return "its own port was taken by another process after the launcher picked it"
    for rank, port in enumerate(plan.ports):
        reason = port_in_use(port)
        if reason is not None:
            return (f"port {port} (worker {rank}'s) is held by another process ({reason}); "
                    "it was taken after the launcher picked it")
    return None


def restart_plan(
    plan: LocalLaunchPlan,
    *,
    restart_count: int,
    cancelled: Callable[[], bool] = lambda: False,
    port_timeout: float = PORT_WAIT_SECONDS,
) -> LocalLaunchPlan:
    """The plan of restart number `restart_count`: same workers, fresh state.

    Every worker gets a new environment from its old one, with
    `TFDP_RESTART_COUNT=restart_count` and, for a one-host launch without a
    fixed port, fresh free ports in TF_CONFIG. Fixed ports (`--port`,
    `--hosts`) are reused once they are free again.

    Args:
        plan: the plan of the attempt that failed.
        restart_count: 1 for the first restart, 2 for the second, ...
        cancelled: polled while waiting for ports; True stops the wait.
            Defaults to never.
        port_timeout: seconds to wait for fixed ports. Defaults to
            `PORT_WAIT_SECONDS`.

    Returns:
        A new `LocalLaunchPlan`.

    Raises:
        OSError: if fixed ports are still in use after `port_timeout`, or no
            free port can be found.
    """
    if plan.fixed_ports:
        _wait_for_free_ports(plan.ports, timeout=port_timeout, cancelled=cancelled)
        ports = plan.ports
        addresses = plan.addresses or tuple(f"{plan.host}:{p}" for p in ports)
    else:
        ports = tuple(local_cluster.free_ports(plan.nproc_per_node,
                                             host=nodes_lib.TENSORFLOW_LISTEN_ADDRESS))
        addresses = tuple(f"{plan.host}:{p}" for p in ports)
    workers = []
    for spec in plan.workers:
        tf_config = cluster_lib.ClusterConfig(
            cluster={"worker": list(addresses)}, task_type="worker", task_index=spec.rank)
        env = dict(spec.env, TF_CONFIG=tf_config.to_json(),
                   TFDP_RESTART_COUNT=str(restart_count))
        workers.append(dataclasses.replace(spec, env=env))
    return dataclasses.replace(plan, ports=ports, addresses=addresses, workers=tuple(workers))


def run_plan(
    plan: LocalLaunchPlan,
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Runs a planned launch to completion (restarts included); returns its exit code.

    While it runs (when called from the main thread), SIGINT and SIGTERM are
    forwarded to the workers instead of ending this process, and never lead
    to a restart. An attempt that fails while another process holds one of
    the free ports the launcher picked (`port_collision`) runs again with new
    ports, up to `tfdp.launch.restarts.MAX_PORT_RETRIES` times, without
    counting as a restart.

    Args:
        plan: from `plan_local` or `plan_nodes`.
        stdout: binary stream for the workers' prefixed stdout. Defaults to
            `sys.stdout.buffer`.
        stderr: binary stream for the workers' prefixed stderr and `[launch] `
            messages. Defaults to `sys.stderr.buffer`.

    Returns:
        0 if every worker exited 0 (in some attempt); else the exit code of
        the worker that failed last (128 + signum if a signal killed it);
        128 + signum if this process received SIGINT (130) or SIGTERM (143);
        126/127 if a worker could not be started.
    """
    warnings = []
    if plan.exposed and not plan.bind_all:
        warnings.append(
            f"warning: workers are reached at {', '.join(plan.exposed)}, which other "
            f"machines can reach; this node's workers listen on {plan.host} only (ports "
            f"{','.join(map(str, plan.ports))}). TensorFlow's gRPC endpoints have no "
            "authentication or encryption: anyone who can reach them can run TensorFlow "
            "operations in the workers. Keep the job on a private, firewalled network.")
    if plan.bind_all:
        reached = (f"workers are reached at {', '.join(plan.exposed)}" if plan.exposed
                   else "every --hosts address is loopback")
        warnings.append(
            f"warning: --bind_all: {reached}. TensorFlow's gRPC endpoints have no "
            "authentication or encryption and listen on all interfaces (ports "
            f"{','.join(map(str, plan.ports))} here): anyone who can reach them can run "
            "TensorFlow operations in the workers. Keep the job on a private, firewalled "
            "network.")
    if plan.bind_warning:
        warnings.append(plan.bind_warning)
    if plan.gpu_warning:
        warnings.append(f"warning: {plan.gpu_warning}")
    if plan.gpus is not None:
        warnings.append(plan.gpus.describe())
    return restarts.run_with_restarts(
        plan,
        describe=lambda p, attempt: p.describe(attempt),
        replan=lambda p, attempt, cancelled: restart_plan(
            p, restart_count=attempt, cancelled=cancelled),
        warnings=warnings,
        stdout=stdout,
        stderr=stderr,
        port_collision=port_collision,
    )


def run_local(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    environ: Mapping[str, str] | None = None,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    max_restarts: int = 0,
    gpus_per_proc: int | None = None,
) -> int:
    """Runs `command` as `nproc_per_node` local workers; returns the exit code.

    `plan_local` then `run_plan`: see those for the arguments, the errors
    raised before anything starts, and the exit codes.

    Example:

    >>> run_local(["python", "train.py"], nproc_per_node=2)
    0
    """
    plan = plan_local(command, nproc_per_node=nproc_per_node, port=port,
                      grace_period=grace_period, environ=environ, max_restarts=max_restarts,
                      gpus_per_proc=gpus_per_proc)
    return run_plan(plan, stdout=stdout, stderr=stderr)
