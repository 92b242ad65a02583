"""Failures between the workers of a multi-worker job, found early and said plainly.

This module owns the checks and messages for what goes wrong *between*
workers, each a `tfdp` error that names the problem, the addresses involved
and the fix, instead of a TensorFlow status or a hang:

- at start, before TensorFlow binds: this worker's own port is already in use
  (`check_own_port`);
- while the strategy starts: a peer that never starts, or an address nobody
  answers on, fails every worker within a start-up timeout
  (`resolve_startup_timeout`, `explain_startup_failure`; the deadline itself
  is set through TensorFlow's coordination service in
  `tfdp._upstream.coordination`);
- right after: workers started with different configurations (model, batch,
  seed, ...) are refused by comparing a digest of each worker's configuration
  with one small all-gather (`check_same_config`);
- while training: a collective that times out (a stuck peer; needs a
  collective timeout, `make_strategy(timeout_seconds=...)`) or a peer that
  stops answering (killed or stopped; TensorFlow's heartbeat) becomes a
  `PeerFailureError` naming the workers (`explain_peer_failures`).

It does not build strategies (`tfdp.distribute.strategy` calls the start-up checks around
the constructor), parse TF_CONFIG (`tfdp.distribute.cluster`) or restart workers (the
launcher's `--max_restarts`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import socket
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tfdp.distribute import cluster as cluster_lib

#: Seconds every worker waits for all the others to start, by default.
DEFAULT_STARTUP_TIMEOUT = 120.0
#: Environment variable that sets the start-up timeout (seconds) when
#: `make_strategy` is not given one: for `tfdp-train` and the launcher.
STARTUP_TIMEOUT_ENV = "TFDP_STARTUP_TIMEOUT"
#: Configuration fields whose per-field digests are compared (to name the
#: fields that differ); a longer configuration is still compared as a whole.
MAX_NAMED_FIELDS = 64
#: Seconds to wait for a TCP connection when probing a peer's port.
_PROBE_SECONDS = 1.0

_TASK_NAME = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_FIX_PORT = (
    "Free the port (stop the process that holds it; `ss -ltnp 'sport = :{port}'` "
    "shows it), or give the job other ports: `tfdp-launch` picks free ports "
    "unless you pass --port, and `--port P` uses P, P+1, ..."
)


class StartupError(RuntimeError):
    """The workers of a multi-worker job could not start together."""


class ConfigMismatchError(ValueError):
    """Workers of one job were started with different configurations."""


class PeerFailureError(RuntimeError):
    """A collective failed because another worker is stuck, stopped or gone."""


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


# --- naming workers ------------------------------------------------------------

def _worker_name(config: cluster_lib.ClusterConfig, job: str, index: int) -> str:
    """`worker 1 (127.0.0.1:2223)`, or `chief (host:port)`."""
    addresses = config.cluster.get(job, ())
    address = addresses[index] if index < len(addresses) else "?"
    label = job if job == "chief" or job == "evaluator" else f"{job} {index}"
    return f"{label} ({address})"


def _tasks_in(text: str, config: cluster_lib.ClusterConfig) -> list[tuple[str, int]]:
    """The cluster tasks named in `text` (as `/job:J/replica:0/task:I`), in order, once each."""
    tasks = []
    for job, index in _TASK_NAME.findall(text):
        task = (job, int(index))
        if task not in tasks and int(index) < len(config.cluster.get(job, ())):
            tasks.append(task)
    return tasks


def _listening(addresses: Sequence[str]) -> dict[str, bool]:
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
_NOISE = ("Graph execution error", "Detected at node", "File ", "[[", "The error could be",
          "Additional GRPC", "RPC:", ":UNKNOWN:")


def _summary(error: BaseException | str, limit: int = 300) -> str:
    """The line of a TensorFlow error (or its text) that says what happened, shortened."""
    lines = [line.strip() for line in str(error).splitlines()]
    useful = [line for line in lines if line and not line.startswith(_NOISE)]
    text = useful[0] if useful else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


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
    the same bind first (`tfdp.distribute.cluster.port_in_use`). Another process can
    still take the port between this check and TensorFlow's bind;
    `explain_startup_failure` translates that error too.

    Args:
        config: this job's cluster and this task; `None` (no cluster) and
            an evaluator (which starts no server) pass.

    Raises:
        StartupError: naming the port, the task and the fix.
    """
    if config is None or config.task_type not in cluster_lib.TRAINING_TASK_TYPES:
        return
    port = own_port(config)
    reason = cluster_lib.port_in_use(port)
    if reason is not None:
        raise StartupError(_port_message(config, port, f"it is in use ({reason})"))


def _port_message(config: cluster_lib.ClusterConfig, port: int, why: str) -> str:
    me = _worker_name(config, config.task_type, config.task_index)
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
    named = [task for task in _tasks_in(_stragglers_part(tensorflow_message), config)
             if task != me]
    peers = [(job, i) for job in cluster_lib.TRAINING_TASK_TYPES
             for i in range(len(config.cluster.get(job, ()))) if (job, i) != me]
    listening = _listening([config.cluster[job][i] for job, i in peers])
    silent = [task for task in peers if not listening[config.cluster[task[0]][task[1]]]]
    missing = named + [task for task in silent if task not in named]
    within = f" within startup_timeout={startup_timeout:g} s" if startup_timeout else ""
    if missing:
        described = []
        for job, i in missing:
            state = ("nothing listens there" if not listening[config.cluster[job][i]]
                     else "its port answers, but it never joined: is it stuck before "
                          "make_strategy, or started with another job's TF_CONFIG?")
            described.append(f"{_worker_name(config, job, i)}: {state}")
        count = "1 other worker" if len(missing) == 1 else f"{len(missing)} other workers"
        who = f"{count} did not answer{within}: " + "; ".join(described)
    else:
        who = f"the workers did not all join{within}"
    return (
        f"MultiWorkerMirroredStrategy could not start on "
        f"{_worker_name(config, *me)}: {who}. Start every worker of the job (the same "
        f"command on each, each with its own TF_CONFIG task), check that the TF_CONFIG "
        f"addresses are right and reachable from this host (firewalls, --hosts), and if "
        f"workers legitimately start later than this, raise the timeout "
        f"(make_strategy(startup_timeout=...) or {STARTUP_TIMEOUT_ENV}=seconds). "
        f"(TensorFlow: {_summary(tensorflow_message)})"
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
        raise StartupError(_port_message(
            config, port, "TensorFlow could not start its gRPC server there (the port was "
            "probably taken after tfdp checked it)")) from error


# --- during training: stuck and dead peers --------------------------------------

def peer_failure_message(
    error: BaseException, config: cluster_lib.ClusterConfig | None,
    collective_timeout: float | None = None,
) -> str | None:
    """What a collective's `DeadlineExceededError` / `UnavailableError` means, or None.

    Args:
        error: the TensorFlow error.
        config: this job's cluster; `None` (one process) returns None.
        collective_timeout: the strategy's collective timeout in seconds, for
            the message. Defaults to `None`.
    """
    if config is None or config.num_workers < 2:
        return None
    text = str(error)
    me = (config.task_type, config.task_index)
    named = [t for t in _tasks_in(text, config) if t != me]
    who = ", ".join(_worker_name(config, *t) for t in named) or "another worker"
    here = _worker_name(config, *me)
    if isinstance(error, tf.errors.DeadlineExceededError):
        limit = f" within {collective_timeout:g} s" if collective_timeout else " in time"
        return (
            f"A collective across the workers did not finish{limit} on {here}: "
            f"{who} is stuck, stopped or far slower (a hang, a SIGSTOP, a much slower "
            f"input pipeline). Look at the other "
            f"workers' output for the cause. If steps legitimately take longer, raise the "
            f"collective timeout (make_strategy(timeout_seconds=...), --collective_timeout). "
            f"(TensorFlow: {_summary(error)})"
        )
    if isinstance(error, tf.errors.UnavailableError):
        return (
            f"{who[0].upper() + who[1:]} stopped answering while {here} trained: it crashed, was killed or stopped (TensorFlow's heartbeat "
            f"timed out). Look at that worker's output for the cause, then start the job "
            f"again (`tfdp-launch --max_restarts N` does it for you; a run with a "
            f"model_dir resumes from its last checkpoint). (TensorFlow: {_summary(error)})"
        )
    return None


@contextlib.contextmanager
def explain_peer_failures(
    *, collective_timeout: float | None = None, environ: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Turns collective failures caused by other workers into a `PeerFailureError`.

    Wrap a multi-worker training run in it (e.g. `tfdp-train`'s call of
    `train_and_evaluate`). Outside a multi-worker job, errors pass through.

    Args:
        collective_timeout: the collective timeout in seconds (for the message).
        environ: the environment holding TF_CONFIG or Slurm's variables.
            Defaults to `os.environ`.

    Raises:
        PeerFailureError: from `DeadlineExceededError` (a collective timed
            out: a stuck peer) or `UnavailableError` (a peer died or stopped).
    """
    try:
        yield
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as error:
        message = peer_failure_message(error, job_cluster(environ), collective_timeout)
        if message is None:
            raise
        raise PeerFailureError(message) from error


def job_cluster(environ: Mapping[str, str] | None = None) -> cluster_lib.ClusterConfig | None:
    """This job's cluster: TF_CONFIG, else a Slurm job step of several tasks, else None."""
    from tfdp.distribute import slurm_env

    environ = os.environ if environ is None else environ
    config = cluster_lib.parse_tf_config(environ=environ)
    if config is None:
        config = slurm_env.cluster_config(environ)
        if config is not None and config.num_workers < 2:
            config = None
    return config


# --- the same configuration on every worker ------------------------------------

def _fields(config: Any, exclude: Sequence[str]) -> dict[str, str]:
    """Field name -> canonical JSON of its value, without `exclude`."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            "`config` must be a mapping (e.g. RunConfig.to_dict()) or a dataclass "
            f"instance. Received: config of type {type(config).__name__}"
        )
    unknown = [name for name in exclude if name not in config]
    if unknown:
        raise ValueError(
            f"`exclude` must name fields of `config`. Received unknown field(s) "
            f"{unknown}; fields are {sorted(config)}"
        )
    return {
        str(name): json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
        for name, value in config.items()
        if name not in exclude
    }


def _pieces(text: str, count: int) -> list[int]:
    """The first `count` 32-bit pieces of sha256(`text`): exact in float64."""
    digest = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(digest[4 * i:4 * i + 4], "big") for i in range(count)]


# Layout of one worker's row: its index, the configuration's digest (128
# bits), the field count, a digest of the field names, then one 32-bit digest
# per field (sorted by name), padded with -1.
_DIGEST = slice(1, 5)
_NUM_FIELDS, _NAMES = 5, 6
_FIELDS_START = 7


def _row(worker_index: int, fields: Mapping[str, str]) -> np.ndarray:
    names = sorted(fields)
    canonical = json.dumps(fields, sort_keys=True)
    row = [float(worker_index), *_pieces(canonical, 4), float(len(names)),
           *_pieces("\n".join(names), 1)]
    row += [_pieces(f"{name}={fields[name]}", 1)[0] for name in names[:MAX_NAMED_FIELDS]]
    row += [-1.0] * (_FIELDS_START + MAX_NAMED_FIELDS - len(row))
    return np.asarray(row, dtype=np.float64)


def _all_gather_rows(strategy: tf.distribute.Strategy, row: np.ndarray,
                     timeout_seconds: float | None) -> np.ndarray:
    """Every replica's copy of its worker's `row`, gathered: [replicas, len(row)]."""
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)

    @tf.function
    def gather():
        def replica_fn():
            value = tf.constant(row[np.newaxis, :], dtype=tf.float64)
            return tf.distribute.get_replica_context().all_gather(value, axis=0,
                                                                  options=options)
        return strategy.run(replica_fn)

    return strategy.experimental_local_results(gather())[0].numpy()


def config_digest(config: Any, *, exclude: Sequence[str] = ()) -> str:
    """The hex digest `check_same_config` compares (sha256 of the canonical JSON, 128 bits)."""
    pieces = _pieces(json.dumps(_fields(config, exclude), sort_keys=True), 4)
    return "".join(f"{p:08x}" for p in pieces)


def check_same_config(
    strategy: tf.distribute.Strategy,
    config: Any,
    *,
    exclude: Sequence[str] = (),
    timeout_seconds: float | None = None,
) -> str:
    """Raises on every worker when the workers' configurations differ.

    Every worker hashes a canonical JSON of `config` (per field, and as a
    whole), and one all-gather of a small float64 row per replica (about 70
    numbers) brings every worker's digests to every worker. Call it on every
    worker right after the strategy is built, before the first real
    collective: workers that build different models or batches otherwise
    hang or fail obscurely in the first all-reduce, and workers with
    different seeds train silently wrong. A single-worker strategy compares
    nothing (and runs no collective).

    Fields that may legitimately differ between workers go in `exclude`
    (`RunConfig` has none today; a per-node `data_dir` would be one).

    Args:
        strategy: the job's strategy; every worker must call this with it.
        config: a mapping of JSON-serialisable values (e.g.
            `RunConfig.to_dict()`) or a dataclass instance.
        exclude: field names left out of the comparison. Defaults to ().
        timeout_seconds: how long to wait for the other workers, in seconds.
            Defaults to `None`: the start-up timeout (`TFDP_STARTUP_TIMEOUT`,
            else 120 s).

    Returns:
        This worker's configuration digest (hex), equal on every worker.

    Raises:
        ConfigMismatchError: on every worker, naming the workers whose
            configuration differs from the chief's and the fields that
            differ (this worker's values of them).
        TypeError, ValueError: `config` is not a mapping or dataclass, or
            `exclude` names a field `config` does not have.
    """
    from tfdp.distribute import strategy as strategy_lib  # strategy imports this module

    fields = _fields(config, exclude)
    digest = config_digest(config, exclude=exclude)
    info = strategy_lib.strategy_info(strategy)
    if info.num_workers < 2:
        return digest
    timeout = resolve_startup_timeout(timeout_seconds)
    rows = _all_gather_rows(strategy, _row(info.worker_index, fields), timeout)
    by_worker = {int(row[0]): row for row in rows}
    chief = by_worker[0]
    differ = sorted(w for w, row in by_worker.items()
                    if not np.array_equal(row[_DIGEST], chief[_DIGEST]))
    if not differ:
        if info.is_chief:
            logging.info("tfdp: all %d workers run the same configuration (digest %s)",
                         info.num_workers, digest)
        return digest
    raise ConfigMismatchError(_mismatch_message(info, fields, by_worker, differ, digest))


def _differing_fields(fields: Mapping[str, str], a: np.ndarray, b: np.ndarray) -> list[str] | None:
    """Fields whose digests differ between rows `a` and `b`; None if the field names differ."""
    if a[_NUM_FIELDS] != b[_NUM_FIELDS] or a[_NAMES] != b[_NAMES]:
        return None
    names = sorted(fields)[:MAX_NAMED_FIELDS]
    return [name for i, name in enumerate(names)
            if a[_FIELDS_START + i] != b[_FIELDS_START + i]]


def _mismatch_message(info, fields, by_worker, differ, digest) -> str:
    me = info.worker_index
    chief = by_worker[0]
    parts = []
    for worker in differ:
        names = _differing_fields(fields, by_worker[worker], chief)
        if names is None:
            what = "its set of fields (are the workers running different tfdp versions?)"
        elif names:
            what = ", ".join(names)
        else:
            what = f"a field past the first {MAX_NAMED_FIELDS} compared by name"
        parts.append(f"worker {worker} differs from the chief (worker 0) in: {what}")
    reference = chief if me != 0 else by_worker[differ[0]]
    mine = _differing_fields(fields, by_worker[me], reference) or []
    values = ", ".join(f"{name}={fields[name]}" for name in mine)
    here = (f" This worker ({me}) has {values}." if values else "")
    fix = ("Start every worker with identical flags (the same command on each; only "
           "TF_CONFIG and the launcher's TFDP_* variables may differ), then run again."
           if info.is_chief else
           "Every worker must get the same flags as the chief (worker 0); see the chief's "
           "output.")
    return (
        f"The workers' configurations differ: {'; '.join(parts)}.{here} {fix} "
        f"(configuration digest here: {digest})"
    )
