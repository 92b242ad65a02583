"""Slurm batch scripts for tfdp jobs: `tfdp-launch slurm ...`.

This module owns one translation: a job description (nodes, tasks per node,
partition, account, time limit, GPUs, CPUs, memory, name, output file,
preemption signal, requeue, a set-up line) and the command every worker runs,
into an `sbatch` script, and its submission. In the job, `srun` starts one task per
worker and each task finds the cluster in Slurm's own environment
(`tfdp.distribute.slurm_env`): no TF_CONFIG and no launcher process on the nodes.

The script's `srun` line runs the command with `--distribution=block` (the
rank layout `tfdp.distribute.slurm_env` expects; Slurm's default, made explicit) and
`--kill-on-bad-exit=1` (one failed task ends the step, like the local
launcher's fail-fast). GPUs: with one task per node, the task sees every GPU
of its node and `MultiWorkerMirroredStrategy` mirrors over them (the usual
set-up); with several tasks per node the GPUs are requested per task
(`--gpus-per-task`, with the `--ntasks` current Slurm requires beside it) so
that Slurm gives each task its own.

Preemption: `--signal=TERM@S` has Slurm send SIGTERM to the tasks (not to the
batch shell or `srun`) S seconds before the time limit; tfdp's workers then
save and exit 42. With `requeue`, the script answers srun's exit status 42 with
`scontrol requeue`: the job goes back to the queue and its rerun resumes from
the workers' `--model_dir` (Slurm holds a requeued job about two minutes before
it is eligible again). A SIGTERM to `srun` itself (`scancel --full`, or a
`B:` signal) makes srun kill the tasks at once ("forcing job termination"),
with no time to save, so `B:` is refused. With `signal` or `requeue`, srun
runs with `--kill-on-bad-exit=0 --wait=60` instead of `--kill-on-bad-exit=1`:
the workers save together but exit one by one (a TensorFlow worker can take
several seconds to exit after its save), and the first exit 42 would otherwise
make srun terminate the rest, the chief maybe while it still writes, and end
with their status instead of 42. A failed worker then ends the step within
60 s rather than at once.

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
_ACCOUNT = re.compile(r"^[A-Za-z0-9_.-]+$")
#: Memory per node: a number, optionally with Slurm's unit K, M (default), G or T.
_MEMORY = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)
#: sbatch --signal: [{R}{B}:]SIG[@SECONDS], SIG a name or number.
_SIGNAL = re.compile(r"^(?:(?P<flags>[RB]{1,2}):)?(?P<sig>(?:SIG)?[A-Z0-9]+)"
                     r"(?:@(?P<seconds>\d+))?$", re.IGNORECASE)
#: Seconds srun waits, with `signal` or `requeue`, after the first task ends
#: before it terminates the others.
PREEMPTION_EXIT_WAIT = 60
#: The exit status of a tfdp worker that saved after SIGTERM
#: (`tfdp.distribute.preemption.PREEMPTION_EXIT_CODE`; not imported: no TensorFlow here).
PREEMPTION_EXIT_CODE = 42


def _time_limit_seconds(time: str) -> int | None:
    """Seconds in a valid Slurm time limit (None: unlimited)."""
    if time.upper() in ("UNLIMITED", "INFINITE"):
        return None
    if "-" in time:  # D-H, D-H:M, D-H:M:S
        days, clock = time.split("-", 1)
        hours, minutes, seconds = ([int(p) for p in clock.split(":")] + [0, 0])[:3]
    else:  # M, M:S, H:M:S
        days, parts = 0, [int(p) for p in time.split(":")]
        hours, minutes, seconds = [0, *parts, 0][:3] if len(parts) < 3 else parts
        if len(parts) == 2:
            minutes, seconds = parts
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


def _check_signal(signal: str, time: str | None) -> str:
    """Checks `--signal`; returns it as written in the script (`TERM@S`)."""
    match = _SIGNAL.match(str(signal))
    if match is None:
        raise ValueError(
            "`signal` must be sbatch's [R:]SIG[@SECONDS], e.g. 'TERM@120' (SIGTERM to the "
            f"tasks 120 s before the time limit). Received: signal={_checks.echo(signal)}"
        )
    name = match.group("sig").upper().removeprefix("SIG")
    if name not in ("TERM", "15"):
        raise ValueError(
            "`signal` must send SIGTERM: it is the signal tfdp's workers save on before "
            f"exiting 42. Received: signal={_checks.echo(signal)}. Use e.g. 'TERM@120'."
        )
    flags = (match.group("flags") or "").upper()
    if "B" in flags:
        raise ValueError(
            "`signal` must not use 'B:': it signals only the batch shell, not the workers "
            "(and a SIGTERM to srun kills them at once, without a save). Received: "
            f"signal={_checks.echo(signal)}. Drop 'B:', e.g. 'TERM@120'."
        )
    seconds = match.group("seconds")
    limit = None if time is None else _time_limit_seconds(time)
    if seconds is not None and limit is not None and int(seconds) >= limit:
        raise ValueError(
            f"`signal` asks for SIGTERM {seconds} s before the time limit, but `time` is "
            f"{time} ({limit} s): the workers would be told to stop before they start. "
            f"Received: signal={_checks.echo(signal)}, time={_checks.echo(time)}. Give a "
            "shorter lead or a longer time limit."
        )
    return (f"{flags}:" if flags else "") + "TERM" + (f"@{seconds}" if seconds else "")


def _check_line(name: str, value: str, rule: str) -> str:
    if not isinstance(value, str) or not value.strip() or "\n" in value or "\r" in value:
        raise ValueError(f"`{name}` must be {rule}, on one line. "
                         f"Received: {name}={_checks.echo(value)}")
    return value


def _check_output(output: str) -> str:
    _check_line("output", output, "a file name pattern such as 'logs/%x-%j.out'")
    if any(c.isspace() for c in output):
        raise ValueError(
            "`output` must not contain whitespace (sbatch splits #SBATCH lines at it). "
            f"Received: output={_checks.echo(output)}"
        )
    return output
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
        account: account to charge, or None for the user's default.
        cpus_per_task: CPUs per task, or None for Slurm's default (1).
        mem: memory per node in Slurm's format (e.g. '32G'), or None.
        output: the job's output file pattern (e.g. 'logs/%x-%j.out'), or
            None for Slurm's `slurm-%j.out`.
        signal: sbatch's `--signal` (SIGTERM to the tasks before the time
            limit, e.g. 'TERM@120'), or None.
        requeue: requeue the job when its workers exit 42 (saved after SIGTERM).
        setup: a shell line run before `srun` (e.g. 'source venv/bin/activate'),
            or None.
    """

    command: tuple[str, ...]
    nodes: int
    ntasks_per_node: int
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int = 0
    job_name: str = "tfdp"
    account: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    output: str | None = None
    signal: str | None = None
    requeue: bool = False
    setup: str | None = None

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
    account: str | None = None,
    cpus_per_task: int | None = None,
    mem: str | None = None,
    output: str | None = None,
    signal: str | None = None,
    requeue: bool = False,
    setup: str | None = None,
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
        account: an account name. Defaults to None.
        cpus_per_task: CPUs per task (>= 1), given to `srun` too (it does not
            inherit sbatch's on Slurm 22.05-23.02). Defaults to None.
        mem: memory per node: an integer with an optional unit K, M, G or T.
            Defaults to None.
        output: the output file pattern (no whitespace); with `requeue`, each
            attempt appends to it. Defaults to None.
        signal: `TERM@SECONDS` or `R:TERM@SECONDS` (SIGTERM only: tfdp saves
            on it; no `B:`; SECONDS below `time`). Defaults to None.
        requeue: on exit status 42, `scontrol requeue` the job. Defaults to
            False.
        setup: one shell line, run before `srun`. Defaults to None.

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
    if account is not None and not _ACCOUNT.match(str(account)):
        raise ValueError(
            "`account` must be one account name (letters, digits, '_', '.', '-'). "
            f"Received: account={_checks.echo(account)}"
        )
    if cpus_per_task is not None:
        _checks.check_int("cpus_per_task", cpus_per_task, minimum=1)
    if mem is not None and not _MEMORY.match(str(mem)):
        raise ValueError(
            "`mem` must be memory per node as an integer with an optional unit K, M, G or "
            f"T, e.g. '32G' or '64000' (megabytes). Received: mem={_checks.echo(mem)}"
        )
    if output is not None:
        output = _check_output(output)
    if signal is not None:
        signal = _check_signal(signal, time)
    if not isinstance(requeue, bool):
        raise TypeError(f"`requeue` must be True or False. Received: requeue={_checks.echo(requeue)}")
    if setup is not None:
        setup = _check_line("setup", setup, "one shell command, e.g. 'source venv/bin/activate'")
    return SlurmJob(command=tuple(command), nodes=nodes, ntasks_per_node=ntasks_per_node,
                    partition=partition, time=time, gpus_per_node=gpus_per_node,
                    job_name=job_name, account=account, cpus_per_task=cpus_per_task,
                    mem=None if mem is None else str(mem).upper(), output=output,
                    signal=signal, requeue=requeue, setup=setup)


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
    if job.account is not None:
        directives.append(f"--account={job.account}")
    if job.time is not None:
        directives.append(f"--time={job.time}")
    if job.gpus_per_node:
        if job.ntasks_per_node == 1:
            directives.append(f"--gpus-per-node={job.gpus_per_node}")
        else:  # Slurm wants the task count beside --gpus-per-task
            directives += [f"--ntasks={job.num_workers}",
                           f"--gpus-per-task={job.gpus_per_node // job.ntasks_per_node}"]
    if job.cpus_per_task is not None:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.mem is not None:
        directives.append(f"--mem={job.mem}")
    if job.output is not None:
        directives.append(f"--output={job.output}")
    if job.signal is not None:
        directives.append(f"--signal={job.signal}")
    if job.requeue:
        directives += ["--requeue", "--open-mode=append"]  # every attempt's output kept
    if job.signal is None and not job.requeue:
        srun = ["srun", "--distribution=block", "--kill-on-bad-exit=1"]
    else:  # the first worker to exit 42 must not end the others' exit (see the docstring)
        srun = ["srun", "--distribution=block", "--kill-on-bad-exit=0",
                f"--wait={PREEMPTION_EXIT_WAIT}"]
    if job.cpus_per_task is not None:
        srun.append(f"--cpus-per-task={job.cpus_per_task}")
    srun_line = f"{shlex.join(srun)} {shlex.join(job.command)}"
    lines = [
        "#!/bin/bash",
        f"# Written by `tfdp-launch slurm`: {job.nodes} node(s) x "
        f"{job.ntasks_per_node} task(s) = {job.num_workers} tfdp worker(s).",
        *(f"#SBATCH {directive}" for directive in directives),
        "",
    ]
    if job.setup is not None:  # before `set -u`: activate scripts and modules may read unset names
        lines += ["set -eo pipefail", job.setup, "set -u"]
    else:
        lines.append("set -euo pipefail")
    lines += [
        "# Each task finds the cluster in srun's SLURM_* variables (tfdp.distribute.slurm_env);",
        "# a TF_CONFIG inherited from the submitting shell would take precedence.",
        "unset TF_CONFIG",
        "export PYTHONUNBUFFERED=1",
    ]
    if not job.requeue:
        lines.append(srun_line)
    else:
        code = PREEMPTION_EXIT_CODE
        lines += [
            f"# Exit status {code}: every worker saved after SIGTERM. Requeue the job; its",
            "# rerun resumes from the saved state.",
            "status=0",
            f"{srun_line} || status=$?",
            f'if [ "$status" -eq {code} ]; then',
            f'  echo "[tfdp] workers saved after SIGTERM (exit {code}); requeueing job '
            '$SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "fi",
            'exit "$status"',
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
