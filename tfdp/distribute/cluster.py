"""Cluster configuration: reading, validating and writing TF_CONFIG.

This module owns the description of a multi-worker job *before* TensorFlow
sees it: which tasks exist, at which `host:port` addresses, and which task this
process is. It parses and validates `TF_CONFIG` (so a typo fails in a second
with a message naming the field, instead of a hang in the first collective),
and writes it back. A cluster of N workers on this host (free ports,
TF_CONFIG for each) is `tfdp.distribute.local_cluster`'s; a Slurm job step's
is `tfdp.distribute.slurm_env`'s.

It does not import TensorFlow and does not build strategies: that is
`tfdp.distribute.strategy`'s job. Launching processes belongs to the `launch` package.

The TF_CONFIG format is TensorFlow's (see `TFConfigClusterResolver`):

    {"cluster": {"chief": ["host:port"], "worker": ["host:port", ...]},
     "task": {"type": "worker", "index": 0}}

tfdp validates it more strictly than TensorFlow does (TensorFlow's own check is
`tensorflow/python/distribute/multi_worker_util.py::_validate_cluster_spec`,
which runs only once the strategy is built, and lets a missing `task.index`
default to 0): everything TensorFlow would reject, plus duplicate addresses,
malformed `host:port` strings, and `ps` tasks unless the caller asks for a
parameter-server cluster (`parse_tf_config(..., parameter_server=True)`, which
`tfdp.make_strategy(kind="parameter_server")` does; its cluster rules are
`tfdp.distribute.parameter_server`'s).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from typing import Any, Mapping, Sequence

from tfdp import _checks

#: Task types `tf.distribute.MultiWorkerMirroredStrategy` understands.
TASK_TYPES = ("chief", "worker", "evaluator")
#: Task types that train (take part in the gradient all-reduce), in rank order.
TRAINING_TASK_TYPES = ("chief", "worker")
#: Task types of a `ParameterServerStrategy` cluster.
PS_TASK_TYPES = ("chief", "worker", "ps", "evaluator")

# A hostname, an IPv4 address or a bracketed IPv6 address, then ":port".
_HOST_PATTERN = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)$")

_FIELD_NAMES = {
    "cluster": "cluster",
    "task_type": "task_type",
    "task_index": "task_index",
}
_TF_CONFIG_FIELD_NAMES = {
    "cluster": 'TF_CONFIG["cluster"]',
    "task_type": 'TF_CONFIG["task"]["type"]',
    "task_index": 'TF_CONFIG["task"]["index"]',
}


def check_address(address: Any, *, where: str) -> str:
    """Returns `address` if it is a valid "host:port" string, else raises."""
    rule = (
        f'`{where}` must be a "host:port" string with a port in [1, 65535], '
        'e.g. "10.0.0.1:2222" or "[::1]:2222".'
    )
    if not isinstance(address, str):
        raise ValueError(f"{rule} Received: {where}={_checks.echo(address)}")
    host, sep, port = address.rpartition(":")
    if not sep or not _HOST_PATTERN.match(host) or (":" in host and not host.startswith("[")):
        raise ValueError(
            f"{rule} Received: {where}={_checks.echo(address)} (the host part is "
            "missing or malformed; IPv6 hosts need brackets)."
        )
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{rule} Received: {where}={_checks.echo(address)} (port {port!r} is not "
            "an integer in [1, 65535])."
        )
    return address


def _validate(
    cluster: Any, task_type: Any, task_index: Any, *, names: Mapping[str, str],
    parameter_server: bool = False,
) -> dict[str, tuple[str, ...]]:
    """Validates a cluster description; returns the cluster as a plain dict.

    `names` maps "cluster", "task_type" and "task_index" to how the user wrote
    them (constructor arguments or TF_CONFIG fields), for the error messages.
    With `parameter_server`, "ps" jobs and tasks are allowed.
    """
    task_types = PS_TASK_TYPES if parameter_server else TASK_TYPES
    cluster_name = names["cluster"]
    type_name = names["task_type"]
    index_name = names["task_index"]

    if not isinstance(cluster, Mapping) or not cluster:
        raise ValueError(
            f"`{cluster_name}` must be a non-empty mapping from task type "
            f'("chief", "worker", "evaluator") to a list of "host:port" '
            f"addresses, e.g. {{\"worker\": [\"127.0.0.1:2222\", "
            f"\"127.0.0.1:2223\"]}}. Received: {cluster_name}={_checks.echo(cluster)}"
        )
    normalized: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for job, addresses in cluster.items():
        if job == "ps" and not parameter_server:
            raise ValueError(
                f'`{cluster_name}` contains a "ps" job. Parameter-server tasks '
                "belong to `tf.distribute.experimental.ParameterServerStrategy`, "
                "which MultiWorkerMirroredStrategy (kind 'auto' or 'multi_worker') "
                "does not support: its tasks are "
                f"{', '.join(TASK_TYPES)}. Remove the \"ps\" job, or train "
                "asynchronously with tfdp.make_strategy(kind='parameter_server'). "
                f"Received: {cluster_name}={_checks.echo(dict(cluster))}"
            )
        if job not in task_types:
            raise ValueError(
                f"`{cluster_name}` keys must be task types in {task_types}. "
                f"Received an unknown task type {_checks.echo(job)} in "
                f"{cluster_name}={_checks.echo(dict(cluster))}"
            )
        if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence):
            raise ValueError(
                f'`{cluster_name}["{job}"]` must be a list of "host:port" strings '
                f"(one per task). Received: {cluster_name}[\"{job}\"]="
                f"{_checks.echo(addresses)}"
            )
        if not addresses:
            raise ValueError(
                f'`{cluster_name}["{job}"]` must list at least one "host:port" '
                f"address; remove the \"{job}\" key if there are no {job} "
                f"tasks. Received: {cluster_name}[\"{job}\"]={_checks.echo(addresses)}"
            )
        for i, address in enumerate(addresses):
            where = f'{cluster_name}["{job}"][{i}]'
            check_address(address, where=where)
            key = address.lower()
            if key in seen:
                raise ValueError(
                    f"Every address in `{cluster_name}` must be unique: two tasks "
                    f"cannot listen on the same host:port. {_checks.echo(address)} is "
                    f"both {seen[key]} and {where}. Give each task its own port. "
                    f"Received: {cluster_name}={_checks.echo(dict(cluster))}"
                )
            seen[key] = where
        normalized[job] = tuple(addresses)

    if len(normalized.get("chief", ())) > 1:
        raise ValueError(
            f'`{cluster_name}["chief"]` must have at most one address (there is '
            "at most one chief; list the other tasks under \"worker\"). "
            f'Received: {cluster_name}["chief"]={_checks.echo(list(normalized["chief"]))}'
        )
    if len(normalized.get("evaluator", ())) > 1:
        raise ValueError(
            f'`{cluster_name}["evaluator"]` must have at most one address (there '
            "is at most one evaluator). "
            f'Received: {cluster_name}["evaluator"]='
            f'{_checks.echo(list(normalized["evaluator"]))}'
        )
    if not any(job in normalized for job in TRAINING_TASK_TYPES):
        raise ValueError(
            f'`{cluster_name}` must contain a "chief" or a "worker" job: those are '
            f"the tasks that train. Received: {cluster_name}={_checks.echo(dict(cluster))}"
        )

    if task_type == "ps" and not parameter_server:
        raise ValueError(
            f'`{type_name}`="ps" is a parameter-server task of '
            "`ParameterServerStrategy`, which MultiWorkerMirroredStrategy (kind 'auto' "
            f"or 'multi_worker') does not support. Use one of {TASK_TYPES}, or "
            "tfdp.make_strategy(kind='parameter_server'). "
            f"Received: {type_name}={_checks.echo(task_type)}"
        )
    if not isinstance(task_type, str) or task_type not in task_types:
        raise ValueError(
            f"`{type_name}` must be one of {task_types}. "
            f"Received: {type_name}={_checks.echo(task_type)}"
        )
    # TensorFlow lets an evaluator be absent from the cluster (it runs on its
    # own, outside the training collectives); everything else must be listed.
    if task_type not in normalized and task_type != "evaluator":
        raise ValueError(
            f"`{type_name}` must name a job in `{cluster_name}`, which has jobs "
            f"{sorted(normalized)}. Received: {type_name}={_checks.echo(task_type)}. "
            f'Add a "{task_type}" list to {cluster_name} or fix the task type.'
        )
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise ValueError(
            f"`{index_name}` must be an integer (this task's position in its "
            f"job's address list). Received: {index_name}={_checks.echo(task_index)}"
        )
    # An evaluator absent from the cluster is the one evaluator: index 0.
    num_tasks = len(normalized[task_type]) if task_type in normalized else 1
    if not 0 <= task_index < num_tasks:
        raise ValueError(
            f"`{index_name}` must be in [0, {num_tasks - 1}]: `{cluster_name}` lists "
            f"{num_tasks} {task_type} task(s). Received: {index_name}={task_index}"
        )
    return normalized


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """A validated multi-worker cluster and this process's place in it.

    Construct it directly, from TF_CONFIG with `parse_tf_config`, or for local
    workers with `parse_tf_config(json.dumps(local_tf_config(...)))`.

    Attributes:
        cluster: task type (`"chief"`, `"worker"`, `"evaluator"`) to that job's
            `"host:port"` addresses, one per task. Stored read-only, with tuple
            values.
        task_type: this process's task type; a key of `cluster` (an
            `"evaluator"` may be absent from it, as in TensorFlow).
        task_index: this process's index in `cluster[task_type]`.
        rpc_layer: TF_CONFIG's optional `rpc_layer` (e.g. `"grpc"`), or `None`.
            Defaults to `None`.

    Raises:
        ValueError: if any field breaks a rule listed in `parse_tf_config`.

    Example:

    >>> config = ClusterConfig(
    ...     cluster={"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
    ...     task_type="worker", task_index=1)
    >>> config.num_workers, config.worker_index, config.is_chief
    (3, 2, False)
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int
    rpc_layer: str | None = None

    def __post_init__(self):
        # A description may hold "ps" jobs; whether a strategy accepts them
        # is `parse_tf_config`'s and the strategy's to say.
        normalized = _validate(
            self.cluster, self.task_type, self.task_index, names=_FIELD_NAMES,
            parameter_server=True,
        )
        if self.rpc_layer is not None and (
            not isinstance(self.rpc_layer, str) or not self.rpc_layer
        ):
            raise ValueError(
                "`rpc_layer` must be a non-empty string such as \"grpc\", or None. "
                f"Received: rpc_layer={_checks.echo(self.rpc_layer)}"
            )
        # Frozen: store an immutable copy so the config cannot change under us.
        object.__setattr__(self, "cluster", types.MappingProxyType(normalized))

    def __reduce__(self):
        # `MappingProxyType` cannot be pickled: rebuild from a plain dict.
        return (_rebuild_cluster_config, (self.to_dict(),))

    def __hash__(self) -> int:
        return hash(
            (tuple(sorted(self.cluster.items())), self.task_type, self.task_index,
             self.rpc_layer)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterConfig):
            return NotImplemented
        return (
            dict(self.cluster) == dict(other.cluster)
            and self.task_type == other.task_type
            and self.task_index == other.task_index
            and self.rpc_layer == other.rpc_layer
        )

    @property
    def num_workers(self) -> int:
        """Number of tasks that train: the chief plus the workers.

        The evaluator is not counted: it does not join the training
        collectives. This is what TensorFlow calls the worker count of a
        training task, and the number of processes each global batch is split
        across.
        """
        return sum(len(self.cluster.get(job, ())) for job in TRAINING_TASK_TYPES)

    @property
    def worker_index(self) -> int | None:
        """This task's global rank among the training tasks, or `None`.

        The chief is rank 0 and worker `i` is rank `i + 1` when there is a chief,
        else rank `i` (TensorFlow's `multi_worker_util.id_in_cluster`). An
        evaluator is not a training task, so its `worker_index` is `None`.
        """
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return self.task_index + len(self.cluster.get("chief", ()))
        return None

    @property
    def is_chief(self) -> bool:
        """Whether this task is the training chief (rank 0).

        True for the `"chief"` task, or for worker 0 when the cluster has no
        chief (TensorFlow's rule). Unlike `multi_worker_util.is_chief`, an
        evaluator is *not* the chief here: the chief is the training task that
        logs progress and owns the job's output files.
        """
        return self.worker_index == 0

    @property
    def address(self) -> str | None:
        """This task's own "host:port", or `None` for an unlisted evaluator."""
        addresses = self.cluster.get(self.task_type)
        return None if addresses is None else addresses[self.task_index]

    def to_dict(self) -> dict[str, Any]:
        """Returns the TF_CONFIG dictionary (plain lists, JSON-serialisable)."""
        tf_config: dict[str, Any] = {
            "cluster": {job: list(addresses) for job, addresses in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_index},
        }
        if self.rpc_layer is not None:
            tf_config["rpc_layer"] = self.rpc_layer
        return tf_config

    def to_json(self) -> str:
        """Returns the TF_CONFIG string for this task (set it as `TF_CONFIG`)."""
        return json.dumps(self.to_dict(), sort_keys=True)


def _rebuild_cluster_config(tf_config: dict[str, Any]) -> ClusterConfig:
    return ClusterConfig(
        cluster=tf_config["cluster"],
        task_type=tf_config["task"]["type"],
        task_index=tf_config["task"]["index"],
        rpc_layer=tf_config.get("rpc_layer"),
    )


def parse_tf_config(
    raw: str | None = None, *, environ: Mapping[str, str] | None = None,
    parameter_server: bool = False,
) -> ClusterConfig | None:
    """Parses and validates a TF_CONFIG string.

    Args:
        raw: the TF_CONFIG JSON string. If `None`, reads the `TF_CONFIG`
            variable from `environ`. Defaults to `None`.
        environ: the environment to read `TF_CONFIG` from when `raw` is `None`.
            Defaults to `os.environ`.
        parameter_server: accept "ps" jobs and tasks (a
            `ParameterServerStrategy` cluster). Defaults to False.

    Returns:
        A `ClusterConfig`, or `None` when TF_CONFIG is unset or empty (a
        single-process job).

    Raises:
        ValueError: naming the field and the fix, when TF_CONFIG: is not valid
            JSON; is not a JSON object; lacks `cluster` or `task`; has a `task`
            that is not an object; has a `task.type` that is missing, `"ps"`
            (without `parameter_server`) or not one of
            `"chief"`, `"worker"`, `"evaluator"`; names a task type absent from
            `cluster` (an evaluator may be absent, as in TensorFlow); has a
            `task.index` that is missing, not an integer, negative or out of
            range; has a cluster job that is unknown, `"ps"` (without
            `parameter_server`), empty or not a
            list; has an address that is not `"host:port"` with a port in
            [1, 65535]; lists the same address twice anywhere in the cluster;
            has more than one chief or more than one evaluator; has no chief
            and no worker; or has an `rpc_layer` that is not a non-empty
            string. Other top-level keys (e.g. `environment`) are ignored, as
            TensorFlow ignores them.
        TypeError: if `raw` is not a string or `None`.
    """
    if raw is None:
        raw = (os.environ if environ is None else environ).get("TF_CONFIG")
        if raw is None:
            return None
    if not isinstance(raw, str):
        raise TypeError(
            f"`raw` must be a TF_CONFIG JSON string or None. "
            f"Received: raw={_checks.echo(raw)} of type {type(raw).__name__}"
        )
    if not raw.strip():
        return None
    try:
        tf_config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"TF_CONFIG must be valid JSON ({e.msg} at line {e.lineno} column "
            f"{e.colno}). Build it with `json.dumps` rather than by hand. "
            f"Received: TF_CONFIG={_checks.echo(raw)}"
        ) from None
    if not isinstance(tf_config, dict):
        raise ValueError(
            'TF_CONFIG must be a JSON object like {"cluster": {...}, "task": '
            '{"type": "worker", "index": 0}}. '
            f"Received: TF_CONFIG={_checks.echo(raw)}"
        )
    for key in ("cluster", "task"):
        if key not in tf_config:
            raise ValueError(
                f'TF_CONFIG must have a "{key}" key: "cluster" maps task types '
                'to "host:port" lists and "task" is {"type": ..., "index": ...}. '
                f"Received: TF_CONFIG={_checks.echo(raw)}"
            )
    task = tf_config["task"]
    if not isinstance(task, dict):
        raise ValueError(
            '`TF_CONFIG["task"]` must be an object {"type": ..., "index": ...}. '
            f'Received: TF_CONFIG["task"]={_checks.echo(task)}'
        )
    if "type" not in task:
        raise ValueError(
            f'`TF_CONFIG["task"]["type"]` is missing; set it to one of '
            f'{TASK_TYPES}. Received: TF_CONFIG["task"]={_checks.echo(task)}'
        )
    if "index" not in task:
        raise ValueError(
            '`TF_CONFIG["task"]["index"]` is missing; set it to this task\'s '
            "position in its job's address list (TensorFlow would silently use "
            "0, which makes two tasks claim the same rank). "
            f'Received: TF_CONFIG["task"]={_checks.echo(task)}'
        )
    rpc_layer = tf_config.get("rpc_layer")
    if rpc_layer is not None and (not isinstance(rpc_layer, str) or not rpc_layer):
        raise ValueError(
            '`TF_CONFIG["rpc_layer"]` must be a non-empty string such as '
            f'"grpc", or absent. Received: TF_CONFIG["rpc_layer"]={_checks.echo(rpc_layer)}'
        )
    cluster, task_type, task_index = tf_config["cluster"], task["type"], task["index"]
    _validate(cluster, task_type, task_index, names=_TF_CONFIG_FIELD_NAMES,
              parameter_server=parameter_server)
    return ClusterConfig(
        cluster=cluster, task_type=task_type, task_index=task_index, rpc_layer=rpc_layer
    )
