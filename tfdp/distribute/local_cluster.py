"""A cluster on this host: free ports, and TF_CONFIG for N local workers.

This module owns what `tfdp-launch` needs to start N workers on one machine:
whether a port can be bound (`port_in_use`), a set of free ports
(`free_ports`) and each worker's TF_CONFIG (`local_tf_config`). Parsing and
validating TF_CONFIG is `tfdp.distribute.cluster`'s. It does not import
TensorFlow.
"""

from __future__ import annotations

import errno
import random
import socket
from typing import Any, Sequence

from tfdp import _checks
from tfdp.distribute import cluster as cluster_lib

#: Exit code of tfdp's programs (`tfdp-train`, `tfdp-predict`) when this
#: worker's own port is taken before TensorFlow could listen on it
#: (`tfdp.distribute.startup.PortInUseError`). `tfdp-launch` reads it as a
#: port collision and runs the attempt again with new ports when it picked
#: them itself. 44, next to the lost-peer code 43.
PORT_IN_USE_EXIT_CODE = 44


def port_in_use(port: int) -> str | None:
    """Why `port` cannot be bound on all interfaces now, or `None` if it can.

    Binds where TensorFlow's gRPC server will listen, whatever TF_CONFIG's
    host part says (all interfaces: the dual-stack `[::]` where IPv6 exists,
    and `0.0.0.0`), with `SO_REUSEADDR` as gRPC sets it, so a port left in
    TIME_WAIT by a previous run counts as free. A process holding the port on
    any one address (even 127.0.0.1) makes it in use.

    Args:
        port: a TCP port in [1, 65535].

    Returns:
        The operating system's reason (e.g. `"Address already in use"`), or
        `None` when the port is free.
    """
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue  # IPv6 present but disabled: nothing to bind there
                return e.strerror or str(e)
    return None


#: The lowest port `free_ports` picks: above the well-known service ports
#: (databases, TensorBoard's 6006, Jupyter's 8888, ...).
LOWEST_PICKED_PORT = 15000
#: Linux's default ephemeral range, when `/proc` does not say.
_DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Not the `random` module's shared generator: a test (or a user) seeding it
# would make concurrent launches pick the same ports.
_PICKER = random.SystemRandom()


def ephemeral_port_range() -> tuple[int, int]:
    """The ports this machine hands out to outgoing connections and `bind(0)`.

    Returns:
        `(first, last)`, inclusive: Linux's `ip_local_port_range`, or its
        default `(32768, 60999)` where that cannot be read.
    """
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            first, last = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_RANGE
    return first, last


def free_ports(n: int, *, host: str = "127.0.0.1") -> list[int]:
    """Returns `n` distinct TCP ports that are free on `host` right now.

    The ports are picked at random below the ephemeral range
    (`ephemeral_port_range`, from `LOWEST_PICKED_PORT` up), where neither an
    outgoing connection nor another program's `bind(0)` is handed a port by
    the kernel, so a port picked here stays free until its worker listens on
    it unless another process asks for that very port. Each is checked as
    TensorFlow will bind it (`port_in_use`: all interfaces) and bound on
    `host` while the others are picked. Where the machine's ephemeral range
    leaves fewer than 1,000 ports below it, the kernel's `bind(0)` picks.
    Another process may still take a port between this call and its use;
    callers that cannot tolerate that should retry on a bind error
    (`tfdp-launch` does: `PORT_IN_USE_EXIT_CODE`).

    Args:
        n: how many ports. Must be >= 1.
        host: the address to bind. Defaults to `"127.0.0.1"`.

    Returns:
        A list of `n` distinct port numbers.

    Raises:
        TypeError: if `n` is not an int.
        ValueError: if `n` < 1.
        OSError: if `host` cannot be bound, or no `n` free ports were found.
    """
    _checks.check_int("n", n)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    below = ephemeral_port_range()[0]
    sockets = []
    try:
        if below - LOWEST_PICKED_PORT < 1000:
            for _ in range(n):
                sock = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind((address, 0))
            return [sock.getsockname()[1] for sock in sockets]
        ports: list[int] = []
        for _ in range(100 * n):
            if len(ports) == n:
                break
            port = _PICKER.randrange(LOWEST_PICKED_PORT, below)
            if port in ports or port_in_use(port) is not None:
                continue
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            try:
                sock.bind((address, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
            ports.append(port)
        if len(ports) < n:
            raise OSError(errno.EADDRINUSE, f"found only {len(ports)} of {n} free ports in "
                          f"[{LOWEST_PICKED_PORT}, {below}) after {100 * n} tries")
        return ports
    finally:
        for sock in sockets:
            sock.close()


def local_tf_config(
    num_workers: int,
    worker_index: int,
    *,
    ports: Sequence[int] | None = None,
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Returns the TF_CONFIG dictionary for one of `num_workers` local workers.

    Every worker is a `"worker"` task (worker 0 is the chief, TensorFlow's
    rule) listening on `host`. Serialise it with `json.dumps` and pass it as
    the worker's `TF_CONFIG` environment variable; all workers of a job must
    get the same `ports`.

    Args:
        num_workers: number of worker processes. Must be >= 1.
        worker_index: this worker's index, in `[0, num_workers)`.
        ports: one port per worker, all distinct, in [1, 65535]. If `None`,
            picks free ports with `free_ports` (only useful when the caller
            passes the result to every worker). Defaults to `None`.
        host: the address every worker listens on. Defaults to `"127.0.0.1"`.

    Returns:
        `{"cluster": {"worker": ["host:port", ...]},
          "task": {"type": "worker", "index": worker_index}}`.

    Raises:
        TypeError: if `num_workers`, `worker_index` or a port is not an int.
        ValueError: if `num_workers` < 1, `worker_index` is out of range,
            `ports` has the wrong length, repeats a port or has a port outside
            [1, 65535], or `host` is malformed.
    """
    _checks.check_int("num_workers", num_workers)
    if isinstance(worker_index, bool) or not isinstance(worker_index, int):
        raise TypeError(
            f"`worker_index` must be an int. Received: worker_index={_checks.echo(worker_index)}"
        )
    if not 0 <= worker_index < num_workers:
        raise ValueError(
            f"`worker_index` must be in [0, {num_workers - 1}] for "
            f"num_workers={num_workers}. Received: worker_index={worker_index}"
        )
    if ports is None:
        ports = free_ports(num_workers, host=host)
    ports = list(ports)
    if len(ports) != num_workers:
        raise ValueError(
            f"`ports` must have one port per worker ({num_workers}). "
            f"Received: ports={_checks.echo(ports)} ({len(ports)} ports)"
        )
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"`ports` must contain ints. Received: ports={_checks.echo(ports)}")
        if not 1 <= port <= 65535:
            raise ValueError(
                f"`ports` must be in [1, 65535]. Received: ports={_checks.echo(ports)}"
            )
    if len(set(ports)) != len(ports):
        raise ValueError(
            f"`ports` must be distinct: two workers cannot share a port. "
            f"Received: ports={_checks.echo(ports)}"
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    addresses = [f"{host}:{port}" for port in ports]
    for i, address in enumerate(addresses):
        cluster_lib.check_address(address, where=f"host:ports[{i}]")
    return {
        "cluster": {"worker": addresses},
        "task": {"type": "worker", "index": worker_index},
    }


def parameter_server_tf_configs(
    num_workers: int,
    num_ps: int,
    *,
    ports: Sequence[int] | None = None,
    host: str = "127.0.0.1",
) -> list[dict[str, Any]]:
    """TF_CONFIG of every task of a `ParameterServerStrategy` cluster on this host.

    One chief (which runs the training program), `num_workers` workers and
    `num_ps` ps tasks (which run `tfdp.distribute.parameter_server.serve`).

    Args:
        num_workers: worker tasks. Must be >= 1.
        num_ps: ps tasks. Must be >= 1.
        ports: `1 + num_workers + num_ps` distinct ports: the chief's, the
            workers', the ps tasks'. Defaults to `None`: `free_ports` picks them.
        host: the address every task listens on. Defaults to `"127.0.0.1"`.

    Returns:
        The TF_CONFIG dictionaries in the order chief, workers, ps; the task
        of each is `tf_config["task"]`.

    Raises:
        ValueError: a count is below 1, or `ports` has the wrong length or
            repeats a port.
    """
    _checks.check_int("num_workers", num_workers)
    _checks.check_int("num_ps", num_ps)
    total = 1 + num_workers + num_ps
    ports = list(free_ports(total, host=host) if ports is None else ports)
    if len(ports) != total or len(set(ports)) != total:
        raise ValueError(
            f"`ports` must be {total} distinct ports (1 chief, {num_workers} worker(s), "
            f"{num_ps} ps). Received: ports={_checks.echo(ports)}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    addresses = [f"{host}:{port}" for port in ports]
    cluster = {"chief": addresses[:1], "worker": addresses[1:1 + num_workers],
               "ps": addresses[1 + num_workers:]}
    tasks = [("chief", 0)] + [("worker", i) for i in range(num_workers)] + [
        ("ps", i) for i in range(num_ps)]
    configs = [{"cluster": cluster, "task": {"type": job, "index": i}} for job, i in tasks]
    for config in configs:  # every address and the task, as TF_CONFIG is checked
        cluster_lib.ClusterConfig(cluster=config["cluster"], task_type=config["task"]["type"],
                                  task_index=config["task"]["index"])
    return configs
