"""Start-up failures between the workers of a multi-worker job, found early and said plainly.

This module owns what can go wrong before the workers train together, each a
`StartupError` that names the problem, the addresses involved and the fix,
instead of a TensorFlow status or a hang:

- at start, before TensorFlow binds: this worker's own port is already in use
  (`check_own_port`);
- while the strategy starts: a peer that never starts, or an address nobody
  answers on, fails every worker within a start-up timeout
  (`resolve_startup_timeout`, `explain_startup_failure`; the deadline itself
  is set through TensorFlow's coordination service in
  `tfdp._upstream.coordination`).

Later failures have their own modules: workers started with different
configurations (`tfdp.distribute.config_check`), and stuck or dead peers while
training (`tfdp.distribute.peer_failures`). It does not build strategies
(`tfdp.distribute.strategy` calls these checks around the constructor), parse
TF_CONFIG (`tfdp.distribute.cluster`) or restart workers (the launcher's
`--max_restarts`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Any, Iterator, Mapping

import tensorflow as tf

from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import local_cluster
from tfdp.distribute import failure_text

#: Seconds every worker waits for all the others to start, by default.
DEFAULT_STARTUP_TIMEOUT = 120.0
#: Environment variable that sets the start-up timeout (seconds) when
#: `make_strategy` is not given one: for `tfdp-train` and the launcher.
STARTUP_TIMEOUT_ENV = "TFDP_STARTUP_TIMEOUT"

_FIX_PORT = (
    "Free the port (stop the process that holds it; `ss -ltnp 'sport = :{port}'` "
    "shows it), or give the job other ports: `tfdp-launch` picks free ports "
    "unless you pass --port, and `--port P` uses P, P+1, ..."
)


class StartupError(RuntimeError):
    """The workers of a multi-worker job could not start together.

    Attributes:
        exit_code: what tfdp's programs exit with for it: 1.
    """

    exit_code = 1


class PortInUseError(StartupError):
    """This worker's own port is taken: another process listens on it or holds it.

    Attributes:
        exit_code: `PORT_IN_USE_EXIT_CODE` (44), which `tfdp-launch` reads as a
            port collision: an attempt on ports it picked runs again on new ones.
    """

    exit_code = local_cluster.PORT_IN_USE_EXIT_CODE


#: Re-exported: the exit code of a `PortInUseError` (44).
PORT_IN_USE_EXIT_CODE = local_cluster.PORT_IN_USE_EXIT_CODE


# --- the start-up timeout ------------------------------------------------------

def check_seconds(name: str, value: Any) -> float:
    """Returns `value` as float seconds if it is a positive finite number, else raises."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(
            f"`{name}` must be a positive, finite number of seconds. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def resolve_startup_timeout(
    startup_timeout: float | None = None, *, environ: Mapping[str, str] | None = None
) -> float:
    """The start-up timeout in seconds: the argument, else the environment, else the default.

    Args:
        startup_timeout: seconds, or `None` to read `TFDP_STARTUP_TIMEOUT`
            from `environ`, falling back to `DEFAULT_STARTUP_TIMEOUT` (120 s).
        environ: the environment. Defaults to `os.environ`.

    Returns:
        Positive, finite seconds.

    Raises:
        ValueError: the argument or `TFDP_STARTUP_TIMEOUT` is not a positive,
            finite number of seconds.
    """
    if startup_timeout is not None:
        return check_seconds("startup_timeout", startup_timeout)
    raw = (os.environ if environ is None else environ).get(STARTUP_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_STARTUP_TIMEOUT
    try:
        return check_seconds(STARTUP_TIMEOUT_ENV, float(raw))
    except ValueError:
        raise ValueError(
            f"{STARTUP_TIMEOUT_ENV} must be a positive, finite number of seconds (how "
            f"long every worker waits for the others to start). Received: "
            f"{STARTUP_TIMEOUT_ENV}={raw!r}. Fix or unset it (default "
            f"{DEFAULT_STARTUP_TIMEOUT:g} s)."
        ) from None


# --- start-up: own port, peers that do not answer ------------------------------

def own_port(config: cluster_lib.ClusterConfig) -> int | None:
    """The port this task's gRPC server will listen on, or `None` (an unlisted evaluator)."""
    address = config.address
    return None if address is None else int(address.rpartition(":")[2])


def check_own_port(config: cluster_lib.ClusterConfig | None) -> None:
    """Raises when this training task's own port is already taken on this machine.

    TensorFlow's gRPC server listens on the port of this task's TF_CONFIG
    address on all interfaces (see `tfdp.launch.nodes`), and fails with a bare
    `UnknownError: Could not start gRPC server` when it cannot. This checks
    the same bind first (`tfdp.distribute.local_cluster.port_in_use`). Another process can
    still take the port between this check and TensorFlow's bind;
    `explain_startup_failure` translates that error too.

    Args:
        config: this job's cluster and this task; `None` (no cluster) and
            an evaluator (which starts no server) pass.

    Raises:
        PortInUseError: naming the port, the task and the fix.
    """
    if config is None or config.task_type not in cluster_lib.TRAINING_TASK_TYPES:
        return
    port = own_port(config)
    reason = local_cluster.port_in_use(port)
    if reason is not None:
        raise PortInUseError(_port_message(config, port, f"it is in use ({reason})"))


def _port_message(config: cluster_lib.ClusterConfig, port: int, why: str) -> str:
    me = failure_text.worker_name(config, config.task_type, config.task_index)
    return (
        f"This worker, {me}, cannot listen on port {port}: {why}. TensorFlow's gRPC "
        f"server listens on its TF_CONFIG port on all interfaces. "
        + _FIX_PORT.format(port=port)
    )


def unanswered_message(
    config: cluster_lib.ClusterConfig, startup_timeout: float | None, tensorflow_message: str
) -> str:
    """The start-up failure message: which workers did not answer, and what to do.

    Names the tasks TensorFlow reports as missing (the coordination service
    lists up to two stragglers; a worker whose leader never answers names the
    leader), each with its address and whether anything listens on it now,
    plus any other peer whose port does not answer a TCP connection.
    """
    me = (config.task_type, config.task_index)
    named = [task for task in failure_text.tasks_in(_stragglers_part(tensorflow_message), config)
             if task != me]
    peers = [(job, i) for job in cluster_lib.TRAINING_TASK_TYPES
             for i in range(len(config.cluster.get(job, ()))) if (job, i) != me]
    listening = failure_text.listening([config.cluster[job][i] for job, i in peers])
    silent = [task for task in peers if not listening[config.cluster[task[0]][task[1]]]]
    missing = named + [task for task in silent if task not in named]
    within = f" within startup_timeout={startup_timeout:g} s" if startup_timeout else ""
    if missing:
        described = []
        for job, i in missing:
            state = ("nothing listens there" if not listening[config.cluster[job][i]]
                     else "its port answers, but it never joined: is it stuck before "
                          "make_strategy, or started with another job's TF_CONFIG?")
            described.append(f"{failure_text.worker_name(config, job, i)}: {state}")
        count = "1 other worker" if len(missing) == 1 else f"{len(missing)} other workers"
        who = f"{count} did not answer{within}: " + "; ".join(described)
    else:
        who = f"the workers did not all join{within}"
    return (
        f"MultiWorkerMirroredStrategy could not start on "
        f"{failure_text.worker_name(config, *me)}: {who}. Start every worker of the job (the same "
        f"command on each, each with its own TF_CONFIG task), check that the TF_CONFIG "
        f"addresses are right and reachable from this host (firewalls, --hosts), and if "
        f"workers legitimately start later than this, raise the timeout "
        f"(make_strategy(startup_timeout=...) or {STARTUP_TIMEOUT_ENV}=seconds). "
        f"(TensorFlow: {failure_text.summary(tensorflow_message)})"
    )


def _stragglers_part(message: str) -> str:
    """The part of a coordination-service error that names the missing tasks."""
    marker = "Some timed out task names:"
    if marker in message:
        return message.split(marker, 1)[1].split("\n\n", 1)[0]
    if "RegisterTask" in message:  # the leader itself never answered
        found = re.search(r"remote target (\S+)", message)
        return found.group(1) if found else ""
    return ""


@contextlib.contextmanager
def explain_startup_failure(
    config: cluster_lib.ClusterConfig | None, startup_timeout: float | None
) -> Iterator[None]:
    """Turns TensorFlow's start-up errors into a `StartupError` that names the workers.

    Wrap the `MultiWorkerMirroredStrategy` constructor in it.

    Raises:
        StartupError: for `DeadlineExceededError` / `UnavailableError` (peers
            that did not answer in time) and for "Could not start gRPC
            server" (this worker's port); other errors pass through.
    """
    try:
        yield
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as error:
        if config is None:
            raise
        raise StartupError(unanswered_message(config, startup_timeout, str(error))) from error
    except tf.errors.UnknownError as error:
        port = None if config is None else own_port(config)
        if port is None or "Could not start gRPC server" not in str(error):
            raise
        raise PortInUseError(_port_message(
            config, port, "TensorFlow could not start its gRPC server there (the port was "
            "probably taken after tfdp checked it)")) from error
