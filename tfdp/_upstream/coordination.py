"""A start-up deadline for MultiWorkerMirroredStrategy, through TensorFlow's coordination service.

This module owns the one private TensorFlow setting tfdp changes when a
multi-worker strategy starts (TensorFlow 2.21). Everything else about
start-up failures (which addresses to name, what to tell the user) is
`tfdp.distribute.startup`'s.

How TensorFlow waits. `MultiWorkerMirroredStrategy.__init__`
(`collective_all_reduce_strategy.py::_initialize_multi_worker`) configures a
"standalone" coordination service led by the chief (or worker 0) unless one is
already configured, then `context.ensure_initialized()` runs the C++
`EnableCollectiveOps`: it starts this worker's gRPC server, registers with the
leader (`CoordinationServiceAgent::Connect`, `RegisterTask`) and waits at the
device-propagation barrier (`WaitForAllTasks`). With TensorFlow's defaults a
missing peer blocks that for an hour: the leader accepts each registration at
once and then waits up to `kDevicePropagationTimeout` (1 h), and a worker
whose leader never answers retries `RegisterTask` for
`kDefaultClusterRegisterTimeout` (1 h). The Python-level `_check_health`
thread (`_check_health_initial_timeout`) is disabled whenever the
coordination service is on, so it does not help.

What tfdp sets. The same service MultiWorkerMirroredStrategy would configure,
plus `cluster_register_timeout_in_ms` and `cluster_register_with_barrier=True`
(a `CoordinationServiceConfig` field `configure_coordination_service` has no
argument for). Then the leader holds every registration at the barrier
`[Init]Wait_for_all_tasks_to_register` and fails it after the timeout with
`DeadlineExceededError` naming (up to two of) the tasks that never registered,
on every worker that did register; a worker whose leader never answers gets
`DeadlineExceededError` from `RegisterTask` after the timeout plus gRPC's
reconnect back-off (about 5 s). Measured with two workers on loopback and a
5 s timeout: 6 s on the leader, 10 s on the other worker.

`tests/_upstream/test_coordination.py` fails when these TensorFlow internals
change, which tells us to update this one file.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

# pylint: disable=g-direct-tensorflow-import
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context

#: The jobs MultiWorkerMirroredStrategy coordinates (its own list).
_COORDINATED_JOBS = ("chief", "worker")


def configure_startup_deadline(
    cluster: Mapping[str, Sequence[str]], task_type: str, timeout_seconds: float
) -> bool:
    """Makes the next MultiWorkerMirroredStrategy give up on missing peers.

    Call right before constructing the strategy, in a process whose
    coordination service is not configured yet.

    Args:
        cluster: job name -> addresses (TF_CONFIG's `cluster`).
        task_type: this task's job; only `"chief"` and `"worker"` tasks join
            the coordination service (as in TensorFlow).
        timeout_seconds: how long every worker waits for all the others to
            register, in seconds (> 0; rounded up to whole milliseconds).

    Returns:
        True if the deadline was configured; False when this task does not
        join the service or a coordination service is already configured in
        this process (then TensorFlow's settings stay as they are).
    """
    ctx = context.context()
    if task_type not in _COORDINATED_JOBS or ctx.coordination_service is not None:
        return False
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster[job]))
        for job in _COORDINATED_JOBS
        if job in cluster
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(
            {job: list(addresses) for job, addresses in cluster.items()}
        ),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=max(1, math.ceil(timeout_seconds * 1000)),
    )
    # No argument of configure_coordination_service sets it; the property
    # returns the config proto the context will use.
    ctx.coordination_service.cluster_register_with_barrier = True
    return True


def reset_for_tests() -> None:
    """Forgets a configured (but unused) coordination service in this process."""
    context.context()._coordination_service_config = None  # pylint: disable=protected-access
