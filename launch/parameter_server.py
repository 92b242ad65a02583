"""One host's parameter-server job: `tfdp-launch --num_ps P --nproc_per_node N -- COMMAND`.

This module owns the launch of a `ParameterServerStrategy` cluster on this
host: the chief runs COMMAND (which builds the strategy with
`tfdp.make_strategy(kind="parameter_server")` and trains with `tfdp.Trainer`),
N worker tasks and P ps tasks run `tfdp.distribute.parameter_server.serve`,
each with its `TF_CONFIG` role (`tfdp.distribute.local_cluster.parameter_server_tf_configs`).

Supervision differs from the synchronous launch (`tfdp.launch.local`): the
servers never exit on their own, so the job ends when the chief does, with
its exit status, and the servers are then stopped (SIGTERM, SIGKILL after the
grace period). A worker task that dies is started again on its own address,
up to `max_restarts` times each: TensorFlow's coordinator has put its steps
back in the queue for the other workers meanwhile, and takes it back when it
listens again. A ps task that dies ends the job (the chief cannot go on
without its variables): everything is stopped, and the exit status is the
chief's if it failed first, else the ps task's. SIGINT/SIGTERM to the
launcher are forwarded to every task, as in `tfdp.launch.local`.

Output lines are prefixed with `[chief] `, `[worker:i] ` and `[ps:j] `.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from typing import BinaryIO, Mapping, Sequence

from tfdp import _checks
from tfdp.distribute import local_cluster
from tfdp.launch import local
from tfdp.launch.signals import SignalCatcher
from tfdp.launch.worker_group import POLL_INTERVAL, WorkerGroup, WorkerSpec, describe_returncode

#: What every worker and ps task runs.
SERVE_CODE = "from tfdp.distribute import parameter_server; parameter_server.serve()"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TaskSpec(WorkerSpec):
    """A `WorkerSpec` whose output prefix is its task (`[worker:1] `) rather than a rank."""

    task: str = ""

    @property
    def prefix(self) -> bytes:
        return f"[{self.task}] ".encode()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PsLaunchPlan:
    """A validated parameter-server launch on this host.

    Attributes:
        command: what the chief runs.
        num_workers: worker tasks.
        num_ps: ps tasks.
        grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
        max_restarts: times each worker task may be started again after it dies.
        tasks: one spec per task, chief first, then workers, then ps tasks.
        bind_warning: why the tasks listen on all interfaces, or "".
    """

    command: tuple[str, ...]
    num_workers: int
    num_ps: int
    grace_period: float
    max_restarts: int
    tasks: tuple[_TaskSpec, ...]
    bind_warning: str = ""

    def describe(self) -> str:
        return (f"starting a parameter-server job on {local.LOOPBACK}: chief "
                f"({' '.join(self.command)}), {self.num_workers} worker(s), {self.num_ps} ps "
                f"task(s); TF_CONFIG cluster {json.loads(self.tasks[0].env['TF_CONFIG'])['cluster']}")


def plan_parameter_server(
    command: Sequence[str],
    *,
    num_workers: int,
    num_ps: int,
    grace_period: float = local.DEFAULT_GRACE_PERIOD,
    max_restarts: int = 0,
    environ: Mapping[str, str] | None = None,
) -> PsLaunchPlan:
    """Validates a parameter-server launch and builds every task's command and environment.

    Args:
        command: the chief's program and arguments (no shell).
        num_workers: worker tasks (`--nproc_per_node`). Must be >= 1.
        num_ps: ps tasks (`--num_ps`). Must be >= 1.
        grace_period: seconds between SIGTERM and SIGKILL. Defaults to 5.
        max_restarts: times each worker task is started again after it dies.
            Defaults to 0.
        environ: every task's base environment. Defaults to `os.environ`.

    Returns:
        A `PsLaunchPlan`.

    Raises:
        TypeError, ValueError: an argument is invalid (nothing was started).
    """
    environ = dict(os.environ if environ is None else environ)
    command = local._check_command(command, environ.get("PATH"))
    _checks.check_int("num_workers", num_workers, minimum=1,
                      hint=" (the worker tasks: --nproc_per_node)")
    _checks.check_int("num_ps", num_ps, minimum=1, hint=" (the ps tasks: --num_ps)")
    local._check_grace_period(grace_period)
    local._check_max_restarts(max_restarts)
    configs = local_cluster.parameter_server_tf_configs(num_workers, num_ps)
    bind_env, bind_warning = local._bind_environment(local.LOOPBACK, environ)
    tasks = []
    for rank, config in enumerate(configs):
        job, index = config["task"]["type"], config["task"]["index"]
        env = dict(environ, **bind_env, TF_CONFIG=json.dumps(config), PYTHONUNBUFFERED="1",
                   TFDP_TASK=f"{job}:{index}")
        env.pop("TFDP_RANK", None)
        program = command if job == "chief" else (sys.executable, "-c", SERVE_CODE)
        tasks.append(_TaskSpec(rank=rank, command=tuple(program), env=env,
                               task=job if job == "chief" else f"{job}:{index}"))
    return PsLaunchPlan(command=command, num_workers=num_workers, num_ps=num_ps,
                        grace_period=float(grace_period), max_restarts=max_restarts,
                        tasks=tuple(tasks), bind_warning=bind_warning)


def run_parameter_server(plan: PsLaunchPlan, *, stdout: BinaryIO | None = None,
                         stderr: BinaryIO | None = None) -> int:
    """Runs the planned job until the chief exits; returns the exit status (module docstring)."""
    groups: dict[int, WorkerGroup] = {}
    restarts = {spec.rank: 0 for spec in plan.tasks}

    def start(spec: _TaskSpec) -> None:
        group = WorkerGroup([spec], stdout=stdout, stderr=stderr)
        groups[spec.rank] = group
        group.start()

    def stop_all(hurry=lambda: False) -> None:
        # Servers first would fail the chief's pending steps: stop the chief first.
        for spec in plan.tasks:
            groups[spec.rank].stop(grace_period=plan.grace_period, hurry=hurry)

    with SignalCatcher() as signals:
        try:
            for spec in plan.tasks:
                start(spec)
            chief = plan.tasks[0]
            log = groups[chief.rank].log
            if plan.bind_warning:
                log(plan.bind_warning)
            log(plan.describe())
            while True:
                if signals.first is not None:
                    log(f"received {signal.Signals(signals.first).name}; forwarding it to "
                        f"every task, SIGKILL after {plan.grace_period:g} s")
                    for group in groups.values():
                        group.send_signal(signals.first)
                    stop_all(hurry=lambda: signals.count > 1)
                    return 128 + signals.first
                for spec in plan.tasks:
                    exited = groups[spec.rank].poll()
                    if not exited:
                        continue
                    code = exited[0].exit_code
                    how = describe_returncode(exited[0].returncode)
                    if spec.task == "chief":
                        log(f"the chief {how}; stopping the worker and ps tasks")
                        stop_all()
                        return code
                    if spec.task.startswith("ps:"):
                        log(f"{spec.task} {how}; the chief cannot go on without its "
                            "variables: stopping every task (restart the job; tfdp.Trainer "
                            "resumes from its last checkpoint)")
                        chief_exit = groups[chief.rank].poll()
                        stop_all()
                        return chief_exit[0].exit_code if chief_exit else code
                    if restarts[spec.rank] < plan.max_restarts:
                        restarts[spec.rank] += 1
                        log(f"{spec.task} {how}; its steps go to the other workers; "
                            f"starting it again on its address (restart "
                            f"{restarts[spec.rank]} of {plan.max_restarts})")
                        groups[spec.rank].close()
                        start(spec)
                    else:
                        log(f"{spec.task} {how}; the chief goes on with the other workers "
                            "(no restart left for it)")
                time.sleep(POLL_INTERVAL)
        finally:
            for group in groups.values():
                group.close()
