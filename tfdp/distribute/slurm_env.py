"""A Slurm job step as a tfdp cluster: node lists, task layout and ports.

This module owns one translation: from the environment `srun` gives each task
of a job step to the `tfdp.distribute.cluster.ClusterConfig` a TF_CONFIG would have
given (every task a `"worker"`, task 0 the chief). It reads only environment
variables; it runs no Slurm command (no `scontrol`) and does not import
TensorFlow. Handing the cluster to TensorFlow is `tfdp.distribute.strategy`'s job;
writing batch scripts is `tfdp.launch.sbatch`'s.

Variables read (all set by `srun` for every task of a step):

- `SLURM_STEP_NUM_TASKS`: tasks in the step. Without it this process is not in
  a job step (a batch script or an `salloc` shell runs one process, whatever
  `--ntasks` says) and `cluster_config` returns `None`.
- `SLURM_PROCID`: this task's rank in the step.
- `SLURM_STEP_NODELIST`: the step's nodes as a Slurm hostlist, e.g.
  `node[01-03],gpu5`.
- `SLURM_STEP_TASKS_PER_NODE`: tasks on each of those nodes, e.g. `2(x3),1`.
- `SLURM_LOCALID`, `SLURMD_NODENAME` (checked when present): this task's rank
  on its node and its node's name.
- Ports: `TFDP_SLURM_PORT_BASE` if set, else the first port of
  `SLURM_STEP_RESV_PORTS` (`srun --resv-ports`), else a base derived from
  `SLURM_JOB_ID` (see `port_base`). The task with local rank `i` on a node
  listens on `base + i`.

Ranks follow Slurm's block distribution (its default): node 0 of the node list
runs ranks 0..n0-1, node 1 the next ones, and so on. A step started with
another distribution (`--distribution=cyclic`) is refused with an error,
because its ranks and addresses would not match.

Why not TensorFlow's `SlurmClusterResolver` (TensorFlow 2.21)? It cannot run on
CPU-only nodes: without `gpus_per_node` it runs `nvidia-smi` (FileNotFoundError
where it is not installed) and with `gpus_per_node=0` it fails with "range()
arg 3 must not be zero". It sorts nodes by name, so `node[9-10]` puts node10
first while Slurm gives rank 0 to node9: tasks then get each other's
addresses. It sets `CUDA_VISIBLE_DEVICES` while the strategy is built, after
tfdp has listed the GPUs. And every job uses ports 8888+, so two jobs sharing a
node collide. `tests/distribute/test_slurm_env.py` checks these upstream failures are still
there.
"""

from __future__ import annotations

import itertools
import os
import re
from typing import Mapping

from tfdp import _checks
from tfdp.distribute.cluster import ClusterConfig

#: Variable overriding the first port of every node's tasks.
PORT_BASE_VAR = "TFDP_SLURM_PORT_BASE"
#: Ports derived from the job id start here and stay below 30000: above the
#: well-known ports and below Linux's ephemeral range (32768-60999).
_DERIVED_PORT_START = 10000
_DERIVED_PORT_SLOTS = 2000
_DERIVED_PORT_STRIDE = 10

_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_PART = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str) -> list[str]:
    """Splits `text` at commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def _expand_range_list(body: str, *, hostlist: str) -> list[str]:
    values = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise ValueError(
                f"Slurm hostlist ranges must be numbers or 'lo-hi' ranges, e.g. "
                f"node[01-03,7]. Received {_checks.echo(item)} in hostlist={_checks.echo(hostlist)}"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(
                f"Slurm hostlist range {low}-{high} goes backwards. "
                f"Received: hostlist={_checks.echo(hostlist)}"
            )
        width = len(low)  # "01-03" keeps its zero padding
        values.extend(str(i).zfill(width) for i in range(int(low), int(high) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm hostlist such as `node[01-03],gpu5` into host names.

    Supports what `srun` writes into `SLURM_STEP_NODELIST`: comma-separated
    entries, each a name with any number of bracketed range lists
    (`node[1-2,5]`, zero padding kept, `rack[1-2]-n[1-2]` expanded in order).
    Order is kept and nothing is deduplicated, as in Slurm.

    Args:
        hostlist: the hostlist string.

    Returns:
        The host names, e.g. `["node01", "node02", "node03", "gpu5"]`.

    Raises:
        TypeError: if `hostlist` is not a string.
        ValueError: if it is empty or malformed (unbalanced brackets, an
            empty entry, a range that is not numeric or goes backwards).
    """
    if not isinstance(hostlist, str):
        raise TypeError(f"`hostlist` must be a string. Received: hostlist={_checks.echo(hostlist)}")
    if not hostlist.strip():
        raise ValueError(f"`hostlist` must name at least one node. Received: hostlist={hostlist!r}")
    hosts: list[str] = []
    for entry in _split_top_level(hostlist.strip()):
        entry = entry.strip()
        if not entry:
            raise ValueError(
                f"Slurm hostlist has an empty entry (two commas in a row, or a "
                f"leading/trailing comma). Received: hostlist={_checks.echo(hostlist)}"
            )
        literals = _BRACKETS.split(entry)  # literal, range, literal, range, ..., literal
        if any(c in part for part in literals[::2] for c in "[]"):
            raise ValueError(
                f"Slurm hostlist has unbalanced or nested brackets in {_checks.echo(entry)}. "
                f"Received: hostlist={_checks.echo(hostlist)}"
            )
        choices = [[literal] if i % 2 == 0 else _expand_range_list(literal, hostlist=hostlist)
                   for i, literal in enumerate(literals)]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands Slurm's tasks-per-node string, e.g. `2(x3),1` -> `[2, 2, 2, 1]`.

    Args:
        tasks_per_node: the `SLURM_STEP_TASKS_PER_NODE` format: comma-separated
            counts, each optionally repeated with `(xN)`.

    Returns:
        One task count per node, in node-list order.

    Raises:
        ValueError: if the string is malformed or a count is 0.
    """
    counts: list[int] = []
    for part in str(tasks_per_node).split(","):
        match = _TASKS_PART.match(part.strip())
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise ValueError(
                "Slurm tasks-per-node must be comma-separated positive counts, each "
                f"optionally repeated as N(xR), e.g. '2(x3),1'. Received part "
                f"{_checks.echo(part)} in tasks_per_node={_checks.echo(tasks_per_node)}"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _read_int(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    value = environ.get(name)
    if value is None or not value.strip():
        raise ValueError(
            f"{name} is not set, but this process is in a Slurm job step "
            "(SLURM_STEP_NUM_TASKS is set). srun sets it for every task; start "
            "the workers with `srun`, or unset SLURM_STEP_NUM_TASKS to run alone."
        )
    value = value.strip()
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}. Received: {name}={_checks.echo(value)}"
        )
    return int(value)


def _read_str(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ValueError(
            f"{name} is not set, but this process is in a Slurm job step "
            "(SLURM_STEP_NUM_TASKS is set). srun sets it for every task; start "
            "the workers with `srun`."
        )
    return value


def port_base(environ: Mapping[str, str] | None = None, *, tasks_per_node: int = 1) -> int:
    """Returns the first port of every node's tasks in this job step.

    In order: `TFDP_SLURM_PORT_BASE`; the first port of
    `SLURM_STEP_RESV_PORTS` (set by `srun --resv-ports`, which reserves ports
    for the step); else `10000 + 10 * (SLURM_JOB_ID % 2000)`, so that two jobs
    sharing a node rarely collide (TensorFlow's resolver uses 8888 for all).
    Without a job id, 8888.

    Args:
        environ: the environment. Defaults to `os.environ`.
        tasks_per_node: the most tasks on one node; ports `base` to
            `base + tasks_per_node - 1` must all be valid. Defaults to 1.

    Returns:
        The port of local rank 0; local rank `i` uses `base + i`.

    Raises:
        ValueError: if a variable is malformed, `SLURM_STEP_RESV_PORTS` holds
            fewer ports than `tasks_per_node`, or the ports would exceed 65535.
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get(PORT_BASE_VAR, "").strip()
    reserved = environ.get("SLURM_STEP_RESV_PORTS", "").strip()
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    if explicit:
        if not explicit.isdigit():
            raise ValueError(
                f"{PORT_BASE_VAR} must be a port number. Received: "
                f"{PORT_BASE_VAR}={_checks.echo(explicit)}"
            )
        base, source = int(explicit), PORT_BASE_VAR
    elif reserved:
        match = re.match(r"^(\d+)(?:-(\d+))?", reserved)
        if match is None:
            raise ValueError(
                "SLURM_STEP_RESV_PORTS must look like '12000-12015'. "
                f"Received: SLURM_STEP_RESV_PORTS={_checks.echo(reserved)}"
            )
        base = int(match.group(1))
        count = int(match.group(2) or base) - base + 1
        if count < tasks_per_node:
            raise ValueError(
                f"SLURM_STEP_RESV_PORTS={reserved!r} reserves {count} port(s) per node, "
                f"but a node runs {tasks_per_node} task(s). Reserve at least "
                f"{tasks_per_node} ports, or set {PORT_BASE_VAR}."
            )
        source = "SLURM_STEP_RESV_PORTS"
    elif job_id.isdigit():
        base = (_DERIVED_PORT_START
                + _DERIVED_PORT_STRIDE * (int(job_id) % _DERIVED_PORT_SLOTS))
        source = f"SLURM_JOB_ID={job_id}"
    else:
        base, source = 8888, "the default"
    if not 1 <= base <= 65536 - tasks_per_node:
        raise ValueError(
            f"The Slurm port base from {source} must be in [1, {65536 - tasks_per_node}] "
            f"so that {tasks_per_node} task(s) per node fit below 65536. Received: {base}"
        )
    return base


def cluster_config(environ: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """Returns this Slurm job step's cluster, or `None` outside a job step.

    Every task of the step is a `"worker"`; the task with `SLURM_PROCID` 0 is
    the chief. Worker addresses are `node:port_base + local_rank`, in rank
    order (Slurm's block distribution: ranks fill the nodes of
    `SLURM_STEP_NODELIST` in order).

    Args:
        environ: the environment. Defaults to `os.environ`.

    Returns:
        A validated `ClusterConfig` (`task_index` = `SLURM_PROCID`), or `None`
        when `SLURM_STEP_NUM_TASKS` is unset (not inside `srun`).

    Raises:
        ValueError: naming the variable, when a Slurm variable is missing or
            malformed; the node list and tasks-per-node disagree with each
            other or with the task count; a node is listed twice; or
            `SLURM_LOCALID` / `SLURMD_NODENAME` show that the step does not use
            the block distribution (`srun --distribution=block`).
    """
    environ = os.environ if environ is None else environ
    if not environ.get("SLURM_STEP_NUM_TASKS", "").strip():
        return None
    num_tasks = _read_int(environ, "SLURM_STEP_NUM_TASKS", minimum=1)
    rank = _read_int(environ, "SLURM_PROCID", minimum=0)
    nodelist = _read_str(environ, "SLURM_STEP_NODELIST")
    tasks_text = _read_str(environ, "SLURM_STEP_TASKS_PER_NODE")
    nodes = expand_hostlist(nodelist)
    tasks = expand_tasks_per_node(tasks_text)
    if len(nodes) != len(tasks):
        raise ValueError(
            f"SLURM_STEP_NODELIST names {len(nodes)} node(s) but "
            f"SLURM_STEP_TASKS_PER_NODE gives {len(tasks)} count(s); they must match. "
            f"Received: SLURM_STEP_NODELIST={nodelist!r}, "
            f"SLURM_STEP_TASKS_PER_NODE={tasks_text!r}"
        )
    if len(set(nodes)) != len(nodes):
        raise ValueError(
            f"SLURM_STEP_NODELIST must name each node once. "
            f"Received: SLURM_STEP_NODELIST={nodelist!r} -> {nodes}"
        )
    if sum(tasks) != num_tasks:
        raise ValueError(
            f"SLURM_STEP_TASKS_PER_NODE={tasks_text!r} adds up to {sum(tasks)} task(s), "
            f"but SLURM_STEP_NUM_TASKS={num_tasks}; they must agree."
        )
    if rank >= num_tasks:
        raise ValueError(
            f"SLURM_PROCID must be in [0, {num_tasks - 1}] for a step of {num_tasks} "
            f"task(s). Received: SLURM_PROCID={rank}"
        )
    base = port_base(environ, tasks_per_node=max(tasks))
    addresses = [f"{node}:{base + i}" for node, count in zip(nodes, tasks)
                 for i in range(count)]
    first = 0
    for node, count in zip(nodes, tasks):
        if rank < first + count:
            my_node, my_local = node, rank - first
            break
        first += count
    _check_block_distribution(environ, rank, my_node, my_local)
    return ClusterConfig(cluster={"worker": addresses}, task_type="worker", task_index=rank)


def _check_block_distribution(environ: Mapping[str, str], rank: int, node: str,
                              local: int) -> None:
    fix = ("tfdp numbers workers with Slurm's block distribution (its default); start "
           "the step with `srun --distribution=block`.")
    local_id = environ.get("SLURM_LOCALID", "").strip()
    if local_id and local_id != str(local):
        raise ValueError(
            f"SLURM_PROCID={rank} should be local task {local} on node {node!r}, but "
            f"SLURM_LOCALID={local_id}. {fix}"
        )
    node_name = environ.get("SLURMD_NODENAME", "").strip()
    if node_name and node_name != node:
        raise ValueError(
            f"SLURM_PROCID={rank} should run on node {node!r} (block distribution over "
            f"SLURM_STEP_NODELIST), but SLURMD_NODENAME={node_name!r}. {fix}"
        )


# Slurm sets the task count of the current job step in SLURM_STEP_NUM_TASKS
# (srun); SLURM_NTASKS / SLURM_NPROCS hold the job's --ntasks in the batch
# script. The cluster of a job step (node lists, ranks, ports) is
# `cluster_config`'s job.
_SLURM_TASK_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


def slurm_num_tasks(environ: Mapping[str, str] | None = None) -> int | None:
    """Returns the number of tasks of the current Slurm job step, or `None`.

    Reads `SLURM_STEP_NUM_TASKS` (set by `srun` in a job step), falling back to
    `SLURM_NTASKS` and then `SLURM_NPROCS` (set for the whole job). This is
    the allocation's task count; how many workers actually run, and where,
    is `cluster_config` (only a job step runs several workers).

    Args:
        environ: the environment to read. Defaults to `os.environ`.

    Returns:
        The task count (>= 1), or `None` outside Slurm.

    Raises:
        ValueError: if the variable is set but is not a positive integer.
    """
    environ = os.environ if environ is None else environ
    for name in _SLURM_TASK_VARS:
        value = environ.get(name)
        if value is None or not value.strip():
            continue
        value = value.strip()
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"{name} must be a positive integer (Slurm's task count). "
                f"Received: {name}={_checks.echo(value)}. Unset it or fix the job "
                "script."
            )
        return int(value)
    return None
