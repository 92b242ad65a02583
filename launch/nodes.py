"""Where every worker of a multi-node job listens: `--hosts` and node ranks.

This module owns the layout of one job over several hosts: which address and
port each worker has, and which global rank. It parses and validates `--hosts`
and checks the addresses against this machine (name resolution, loopback or
not, "is this node's address really mine?"). It does not build worker
environments (`tfdp.launch.local`) and does not start processes
(`tfdp.launch.worker_group`).

The layout rule. With `--hosts h0:p0,h1:p1,...` and `--nproc_per_node N`:

- entry `r` of `--hosts` is node `r`: the address its workers are reached at,
  and the port of its first worker;
- node `r`'s local worker `i` listens on `h_r:(p_r + i)` and has global rank
  `r * N + i`;
- every worker's TF_CONFIG lists all `M * N` workers in global-rank order as
  `"worker"` tasks, so worker 0 (node 0, local worker 0) is the chief.

Every node runs the same launcher command, except for its own `--node_rank`.

How TensorFlow binds (TensorFlow 2.21, checked on this version): the gRPC
server of a worker always listens on *all* interfaces, on the port of its own
TF_CONFIG address. `GrpcServer::Init` calls
`AddListeningPort("0.0.0.0:" + port)` (gRPC opens it as the dual-stack `[::]`)
whatever the host part says; the host part only tells the *other* workers
where to connect. There is no TF_CONFIG field, `ServerDef` field or
environment variable that restricts the listening address. What the
launcher does:

- without `--bind_all`, it preloads `tfdp.launch.bind`'s `bind()` shim into every
  worker, which turns the wildcard bind into a bind of the worker's own
  address from `--hosts` (loopback by default, so nothing outside the
  machine can reach it);
- a job whose `--hosts` other machines can reach logs a warning: TensorFlow's
  gRPC endpoints have no authentication or encryption, so run it on a
  private network, behind a firewall;
- `--bind_all` turns the shim off (the workers listen on all interfaces) and
  logs that warning too;
- it checks that ports are free on all interfaces (`0.0.0.0`), which is what
  the worker binds with `--bind_all` (and is stricter than the shim's bind).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from typing import Sequence

from tfdp.distribute import cluster as cluster_lib
from tfdp.launch import _checks

#: The address TensorFlow's gRPC server actually listens on (all interfaces).
TENSORFLOW_LISTEN_ADDRESS = "0.0.0.0"

_HOSTS_EXAMPLE = "--hosts 10.0.0.1:2222,10.0.0.2:2222"




@dataclasses.dataclass(frozen=True)
class HostPort:
    """One `--hosts` entry: a node's address and its first worker's port.

    Attributes:
        host: host name, IPv4 address or IPv6 address (without brackets).
        port: port of the node's local worker 0, in [1, 65535].
    """

    host: str
    port: int

    def address(self, offset: int = 0) -> str:
        """`"host:port+offset"`, with brackets around an IPv6 host."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port + offset}"

    def __str__(self) -> str:
        return self.address()


def parse_hosts(hosts: str | Sequence[str]) -> tuple[HostPort, ...]:
    """Parses `--hosts`: `"h0:p0,h1:p1,..."` or a list of `"host:port"` strings.

    Args:
        hosts: comma-separated `host:port` entries, one per node in node-rank
            order (IPv6 hosts in brackets, e.g. `[fd00::2]:2222`), or a
            sequence of such entries.

    Returns:
        One `HostPort` per entry.

    Raises:
        TypeError: if `hosts` is neither a string nor a sequence of strings.
        ValueError: if it is empty, or an entry is not `host:port` with a port
            in [1, 65535].
    """
    if isinstance(hosts, str):
        entries = [entry.strip() for entry in hosts.split(",")]
    elif isinstance(hosts, Sequence) and all(isinstance(e, str) for e in hosts):
        entries = [entry.strip() for entry in hosts]
    else:
        raise TypeError(
            "`hosts` must be a string like 'h0:2222,h1:2222' or a list of 'host:port' "
            f"strings. Received: hosts={_checks.echo(hosts)}"
        )
    if not any(entries):
        raise ValueError(
            "`hosts` must list every node as host:port, in node-rank order, e.g. "
            f"{_HOSTS_EXAMPLE}. Received: hosts={_checks.echo(hosts)}"
        )
    parsed = []
    for rank, entry in enumerate(entries):
        try:
            cluster_lib.ClusterConfig(cluster={"worker": [entry]}, task_type="worker",
                                      task_index=0)
        except ValueError:
            raise ValueError(
                f"`hosts` entry {rank} must be host:port with a port in [1, 65535] (IPv6 "
                f"hosts in brackets, e.g. [fd00::2]:2222), like {_HOSTS_EXAMPLE}. "
                f"Received: {_checks.echo(entry)} in hosts={_checks.echo(hosts)}"
            ) from None
        host, _, port = entry.rpartition(":")
        parsed.append(HostPort(host.strip("[]"), int(port)))
    return tuple(parsed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """A validated multi-node layout, seen from one node (see the module docstring).

    Attributes:
        hosts: one entry per node, in node-rank order.
        node_rank: this node's index in `hosts`.
        nproc_per_node: workers on every node.
    """

    hosts: tuple[HostPort, ...]
    node_rank: int
    nproc_per_node: int

    @property
    def nnodes(self) -> int:
        """Number of nodes."""
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        """Number of workers in the whole job."""
        return self.nnodes * self.nproc_per_node

    @property
    def this_node(self) -> HostPort:
        """This node's `--hosts` entry."""
        return self.hosts[self.node_rank]

    @property
    def ports(self) -> tuple[int, ...]:
        """This node's worker ports, by local rank."""
        return tuple(self.this_node.port + i for i in range(self.nproc_per_node))

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every worker's `host:port`, in global-rank order (TF_CONFIG's list)."""
        return tuple(entry.address(i) for entry in self.hosts
                     for i in range(self.nproc_per_node))

    def global_rank(self, local_rank: int) -> int:
        """The global rank of this node's worker `local_rank`."""
        return self.node_rank * self.nproc_per_node + local_rank


def plan_layout(
    hosts: str | Sequence[str],
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
) -> NodeLayout:
    """Validates a multi-node layout (no network access; see `check_hosts`).

    Args:
        hosts: see `parse_hosts`; exactly one entry per node.
        nnodes: number of nodes (>= 1).
        node_rank: this node's rank, in [0, nnodes).
        nproc_per_node: workers per node (>= 1).

    Returns:
        A `NodeLayout`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if `hosts` is malformed or has not `nnodes` entries,
            `node_rank` is out of range, a node's ports `port..port+N-1` go
            past 65535, or two workers would get the same `host:port`.
    """
    _checks.check_int("nnodes", nnodes, minimum=1)
    _checks.check_int("nproc_per_node", nproc_per_node, minimum=1)
    _checks.check_int("node_rank", node_rank, minimum=0)
    entries = parse_hosts(hosts)
    if len(entries) != nnodes:
        raise ValueError(
            f"`hosts` must have one host:port entry per node: nnodes={nnodes}, but it has "
            f"{len(entries)}. Received: hosts={_checks.echo(','.join(map(str, entries)))}"
        )
    if node_rank >= nnodes:
        raise ValueError(
            f"`node_rank` must be in [0, {nnodes - 1}] for nnodes={nnodes} (this node's "
            f"position in `hosts`). Received: node_rank={node_rank}"
        )
    for rank, entry in enumerate(entries):
        last = entry.port + nproc_per_node - 1
        if last > 65535:
            raise ValueError(
                f"`hosts` entry {rank} ({entry}) starts {nproc_per_node} workers at ports "
                f"{entry.port}..{last}, past 65535. Use a first port <= "
                f"{65536 - nproc_per_node}."
            )
    owners: dict[tuple[str, int], int] = {}
    for rank, entry in enumerate(entries):
        for i in range(nproc_per_node):
            key = (entry.host.lower(), entry.port + i)
            if key in owners:
                raise ValueError(
                    f"`hosts` entries {owners[key]} and {rank} both give a worker "
                    f"{entry.address(i)}: node r's workers use ports port_r..port_r+"
                    f"{nproc_per_node - 1}, so nodes on the same host need port ranges "
                    f"that do not overlap. Received: "
                    f"hosts={_checks.echo(','.join(map(str, entries)))}"
                )
            owners[key] = rank
    layout = NodeLayout(hosts=entries, node_rank=node_rank, nproc_per_node=nproc_per_node)
    # The final word on the cluster's shape is tfdp.distribute.cluster's validation.
    cluster_lib.ClusterConfig(cluster={"worker": list(layout.addresses)}, task_type="worker",
                              task_index=layout.global_rank(0))
    return layout


def _resolve(entry: HostPort, rank: int) -> set[str]:
    try:
        infos = socket.getaddrinfo(entry.host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(
            f"`hosts` entry {rank} ({entry}): cannot resolve host {entry.host!r} "
            f"({e.strerror}). Every node must resolve every node's name; use IP "
            "addresses or fix the name service."
        ) from None
    return {info[4][0] for info in infos}


def _is_loopback(addresses: set[str]) -> bool:
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return True


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def check_hosts(layout: NodeLayout, *, bind_all: bool) -> list[str]:
    """Checks the layout's addresses against the network and this machine.

    Resolves every host; refuses two entries that resolve to the same
    address with overlapping port ranges; lists the addresses other machines
    can reach (for the launcher's warning); checks that this node's own
    address belongs to this machine (a wrong `node_rank` would otherwise make
    two processes claim the same rank and hang the job); and refuses this
    node's entry when it is a name that resolves to loopback here (Debian's
    `127.0.1.1`) while other entries are on other machines, which could not
    reach it. (A loopback IP literal is taken as meant, e.g. for tunnels.)

    Args:
        layout: from `plan_layout`.
        bind_all: whether the workers will listen on all interfaces
            (`--bind_all`).

    Returns:
        The non-loopback `--hosts` entries, as `host:port` strings (empty for
        a job on loopback addresses only).

    Raises:
        ValueError: naming the `hosts` entry, if a host does not resolve,
            two entries overlap, this node's address is not this machine's, or
            this node's name resolves to loopback in a job with other machines.
    """
    resolved = [_resolve(entry, rank) for rank, entry in enumerate(layout.hosts)]
    n = layout.nproc_per_node
    for a in range(layout.nnodes):
        for b in range(a + 1, layout.nnodes):
            same = resolved[a] & resolved[b]
            pa, pb = layout.hosts[a].port, layout.hosts[b].port
            if same and pa < pb + n and pb < pa + n:
                raise ValueError(
                    f"`hosts` entries {a} ({layout.hosts[a]}) and {b} ({layout.hosts[b]}) "
                    f"are the same machine ({sorted(same)[0]}) with overlapping port ranges "
                    f"{pa}..{pa + n - 1} and {pb}..{pb + n - 1}. Give them port ranges "
                    f"that do not overlap."
                )
    exposed = [str(entry) for entry, addresses in zip(layout.hosts, resolved)
               if not _is_loopback(addresses)]
    mine = resolved[layout.node_rank]
    if exposed and _is_loopback(mine) and not _is_literal(layout.this_node.host):
        raise ValueError(
            f"`hosts` entry {layout.node_rank} ({layout.this_node}) names this machine, but "
            f"the name resolves here to {', '.join(sorted(mine))}, a loopback address "
            "(Debian's /etc/hosts maps a machine's own name to 127.0.1.1), while other "
            f"nodes are on other machines ({exposed[0]}): their workers could not reach "
            "this node's, which listen on that address only, and the job would hang at "
            "start. Give this node's network address in `hosts` (its IP address, or a "
            "name that resolves to it here too)."
        )
    if not any(_bindable(address) for address in mine):
        raise ValueError(
            f"`node_rank` must be the position of this machine's own entry in `hosts`, "
            f"but entry {layout.node_rank} ({layout.this_node}) resolves to "
            f"{', '.join(sorted(mine))}, which is not an address of this machine. Pass "
            "this machine's --node_rank, or fix `hosts` (each entry is the address its "
            f"node is reached at). Received: node_rank={layout.node_rank}"
        )
    return exposed
