"""How tfdp's failure messages name workers and quote TensorFlow.

This module owns the wording shared by the start-up and peer-failure
messages (`tfdp.distribute.startup`, `tfdp.distribute.peer_failures`): a
worker as `worker 1 (127.0.0.1:2223)`, the tasks a TensorFlow error names,
which peers accept TCP connections, and the one line of a TensorFlow error
that says what happened. It raises nothing and imports no TensorFlow.
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
from typing import Sequence

from tfdp.distribute import cluster as cluster_lib

#: Seconds to wait for a TCP connection when probing a peer's port.
_PROBE_SECONDS = 1.0

_TASK_NAME = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")


def worker_name(config: cluster_lib.ClusterConfig, job: str, index: int) -> str:
    """`worker 1 (127.0.0.1:2223)`, or `chief (host:port)`."""
    addresses = config.cluster.get(job, ())
    address = addresses[index] if index < len(addresses) else "?"
    label = job if job == "chief" or job == "evaluator" else f"{job} {index}"
    return f"{label} ({address})"


def tasks_in(text: str, config: cluster_lib.ClusterConfig) -> list[tuple[str, int]]:
    """The cluster tasks named in `text` (as `/job:J/replica:0/task:I`), in order, once each."""
    tasks = []
    for job, index in _TASK_NAME.findall(text):
        task = (job, int(index))
        if task not in tasks and int(index) < len(config.cluster.get(job, ())):
            tasks.append(task)
    return tasks


def listening(addresses: Sequence[str]) -> dict[str, bool]:
    """Whether something accepts TCP connections on each `host:port`, probed concurrently."""

    def probe(address: str) -> bool:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_SECONDS):
                return True
        except OSError:
            return False

    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return dict(zip(addresses, pool.map(probe, addresses)))


# Lines of a TensorFlow error that say where, not what.
NOISE = ("Graph execution error", "Detected at node", "File ", "[[", "The error could be",
          "Additional GRPC", "RPC:", ":UNKNOWN:")


def summary(error: BaseException | str, limit: int = 300) -> str:
    """The line of a TensorFlow error (or its text) that says what happened, shortened."""
    lines = [line.strip() for line in str(error).splitlines()]
    useful = [line for line in lines if line and not line.startswith(NOISE)]
    text = useful[0] if useful else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."
