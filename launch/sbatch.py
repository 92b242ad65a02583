"""Slurm batch scripts for tfdp jobs: `tfdp-launch slurm ...`.

This module owns one translation: a job description (nodes, tasks per node,
partition, time limit, GPUs, name) and the command every worker runs, into an
`sbatch` script, and its submission. In the job, `srun` starts one task per
worker and each task finds the cluster in Slurm's own environment
(`tfdp.distribute.slurm_env`): no TF_CONFIG and no launcher process on the nodes.

The script's `srun` line runs the command with `--distribution=block` (the
rank layout `tfdp.distribute.slurm_env` expects; Slurm's default, made explicit) and
`--kill-on-bad-exit=1` (one failed task ends the step, like the local
launcher's fail-fast). GPUs: with one task per node, the task sees every GPU
of its node and `MultiWorkerMirroredStrategy` mirrors over them (the usual
set-up); with several tasks per node the GPUs are requested per task
(`--gpus-per-task`) so that Slurm gives each task its own.

Reading Slurm's environment in the workers is `tfdp.distribute.slurm_env`'s job; parsing
flags is `tfdp.launch.__main__`'s.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
from typing import Mapping, Sequence

from tfdp.launch import _checks

#: Slurm time limits: minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s, or unlimited.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}"
                   r"|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)$", re.IGNORECASE)
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")




@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """A validated Slurm job: what `batch_script` writes.

    Attributes:
        command: program and arguments every task runs.
        nodes: number of nodes.
        ntasks_per_node: tasks (tfdp workers) per node.
        partition: partition name(s), or None for the cluster's default.
        time: time limit in Slurm's format, or None for the partition's.
        gpus_per_node: GPUs per node (0: none requested).
        job_name: the job's name.
    """

    command: tuple[str, ...]
    nodes: int
    ntasks_per_node: int
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int = 0
    job_name: str = "tfdp"

    @property
    def num_workers(self) -> int:
        """Total tasks, one tfdp worker each."""
        return self.nodes * self.ntasks_per_node


def plan_job(
    command: Sequence[str],
    *,
    nodes: int,
    ntasks_per_node: int,
    partition: str | None = None,
    time: str | None = None,
    gpus_per_node: int = 0,
    job_name: str = "tfdp",
) -> SlurmJob:
    """Validates a Slurm job description.

    The command is not looked up on this machine: the nodes may have another
    environment (modules, containers).

    Args:
        command: program and arguments every task runs (no shell).
        nodes: number of nodes (>= 1).
        ntasks_per_node: tasks per node (>= 1); each task is one worker.
        partition: partition, or comma-separated partitions. Defaults to None.
        time: time limit: minutes, `M:S`, `H:M:S`, `D-H`, `D-H:M` or
            `D-H:M:S`. Defaults to None.
        gpus_per_node: GPUs per node (>= 0), divisible by `ntasks_per_node`
            when both are > 1 and > 0. Defaults to 0.
        job_name: letters, digits and `_.+-`. Defaults to `"tfdp"`.

    Returns:
        A `SlurmJob`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: naming the argument, when a value breaks its rule.
    """
    command = _checks.check_command(
        command,
        example="tfdp-launch slurm --nodes 2 --ntasks_per_node 1 -- python train.py")
    _checks.check_int("nodes", nodes, minimum=1)
    _checks.check_int("ntasks_per_node", ntasks_per_node, minimum=1)
    _checks.check_int("gpus_per_node", gpus_per_node, minimum=0)
    if gpus_per_node and ntasks_per_node > 1 and gpus_per_node % ntasks_per_node:
        raise ValueError(
            f"`gpus_per_node` must be a multiple of `ntasks_per_node` so that every task "
            f"gets the same number of GPUs. Received: gpus_per_node={gpus_per_node}, "
            f"ntasks_per_node={ntasks_per_node}. Use one task per node (its worker mirrors "
            "over all the node's GPUs) or one task per GPU."
        )
    if partition is not None and not _PARTITION.match(str(partition)):
        raise ValueError(
            "`partition` must be a partition name or a comma-separated list of names "
            f"(letters, digits, '_', '.', '-'). Received: partition={_checks.echo(partition)}"
        )
    if time is not None and not _TIME.match(str(time)):
        raise ValueError(
            "`time` must be a Slurm time limit: minutes, M:S, H:M:S, D-H, D-H:M or "
            f"D-H:M:S, e.g. '90' or '1-12:00:00'. Received: time={_checks.echo(time)}"
        )
    if not isinstance(job_name, str) or not _JOB_NAME.match(job_name):
        raise ValueError(
            "`job_name` must be letters, digits and '_', '.', '+', '-' (no spaces). "
            f"Received: job_name={_checks.echo(job_name)}"
        )
    return SlurmJob(command=tuple(command), nodes=nodes, ntasks_per_node=ntasks_per_node,
                    partition=partition, time=time, gpus_per_node=gpus_per_node,
                    job_name=job_name)


def batch_script(job: SlurmJob) -> str:
    """Returns the `sbatch` script for `job` (`#SBATCH` lines, then `srun`).

    Example:

    >>> print(batch_script(plan_job(["python", "train.py"], nodes=2, ntasks_per_node=1)))
    #!/bin/bash
    ...
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    ...
    srun --distribution=block --kill-on-bad-exit=1 python train.py
    """
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}",
                  f"--ntasks-per-node={job.ntasks_per_node}"]
    if job.partition is not None:
        directives.append(f"--partition={job.partition}")
    if job.time is not None:
        directives.append(f"--time={job.time}")
    if job.gpus_per_node:
        if job.ntasks_per_node == 1:
            directives.append(f"--gpus-per-node={job.gpus_per_node}")
        else:
            directives.append(f"--gpus-per-task={job.gpus_per_node // job.ntasks_per_node}")
    lines = [
        "#!/bin/bash",
        f"# Written by `tfdp-launch slurm`: {job.nodes} node(s) x "
        f"{job.ntasks_per_node} task(s) = {job.num_workers} tfdp worker(s).",
        *(f"#SBATCH {directive}" for directive in directives),
        "",
        "set -euo pipefail",
        "# Each task finds the cluster in srun's SLURM_* variables (tfdp.distribute.slurm_env);",
        "# a TF_CONFIG inherited from the submitting shell would take precedence.",
        "unset TF_CONFIG",
        "export PYTHONUNBUFFERED=1",
        f"srun --distribution=block --kill-on-bad-exit=1 {shlex.join(job.command)}",
    ]
    return "\n".join(lines) + "\n"


def submit(script: str, *, environ: Mapping[str, str] | None = None,
           timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Submits `script` with `sbatch` (which reads it from stdin).

    Args:
        script: the batch script, from `batch_script`.
        environ: environment of `sbatch` (its PATH finds it). Defaults to
            this process's.
        timeout: seconds `sbatch` may take. Defaults to 120.

    Returns:
        The finished `sbatch` process (`stdout` has "Submitted batch job N").

    Raises:
        ValueError: if `sbatch` is not on PATH.
        subprocess.TimeoutExpired: if `sbatch` takes longer than `timeout`.
    """
    path = None if environ is None else environ.get("PATH", "")
    sbatch = shutil.which("sbatch", path=path)
    if sbatch is None:
        raise ValueError(
            "`--submit` needs Slurm's `sbatch` on PATH, and it was not found. Run this on "
            "a machine that can submit Slurm jobs (a login node), or leave out --submit "
            "and save the script: `tfdp-launch slurm ... > job.sbatch`, then "
            "`sbatch job.sbatch` there."
        )
    return subprocess.run([sbatch], input=script, capture_output=True, text=True,
                          env=None if environ is None else dict(environ), timeout=timeout,
                          check=False)
