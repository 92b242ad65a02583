"""`tfdp-launch --num_ps P --nproc_per_node N`: a chief, N worker and P ps tasks on this host."""

import json
from pathlib import Path

import pytest

import multiworker
from tfdp.launch import parameter_server as ps_launch

JOB = Path(__file__).parents[1] / "training" / "parameter_server_job.py"


def test_plan_gives_every_task_its_role(tmp_path):
    plan = ps_launch.plan_parameter_server(["true"], num_workers=2, num_ps=1)
    roles = [json.loads(spec.env["TF_CONFIG"])["task"] for spec in plan.tasks]
    assert roles == [{"type": "chief", "index": 0}, {"type": "worker", "index": 0},
                     {"type": "worker", "index": 1}, {"type": "ps", "index": 0}]
    assert plan.tasks[0].command[0].endswith("true")
    assert all(spec.command[-1] == ps_launch.SERVE_CODE for spec in plan.tasks[1:])
    assert [spec.prefix for spec in plan.tasks] == [b"[chief] ", b"[worker:0] ",
                                                   b"[worker:1] ", b"[ps:0] "]
    cluster = json.loads(plan.tasks[0].env["TF_CONFIG"])["cluster"]
    assert (len(cluster["worker"]), len(cluster["ps"]), len(cluster["chief"])) == (2, 1, 1)


@pytest.mark.parametrize("flags,named", [
    (["--port", "5000"], "--port"), (["--gpus_per_proc", "0"], "--gpus_per_proc"),
])
def test_flags_of_the_synchronous_launch_are_refused(flags, named):
    result = multiworker.run_launch(["true"], nproc=2, launch_args=["--num_ps", "1", *flags],
                                    timeout=60)
    assert result.returncode == 2
    assert "--num_ps launches a parameter-server job on this host only" in result.stderr
    assert named in result.stderr


def test_num_ps_must_be_positive():
    result = multiworker.run_launch(["true"], nproc=2, launch_args=["--num_ps", "0"],
                                    timeout=60)
    assert result.returncode == 2 and "num_ps" in result.stderr


@pytest.mark.slow
def test_a_parameter_server_job_trains_and_every_task_stops(tmp_path):
    result = multiworker.run_launch(
        multiworker.python_command(JOB, "--steps", "40", "--model_dir", str(tmp_path / "m")),
        nproc=2, launch_args=["--num_ps", "1", "--grace_period", "2"], timeout=300,
        check=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("[chief] RESULT ")]
    assert lines, result.stdout[-3000:]
    job = json.loads(lines[-1][len("[chief] RESULT "):])
    assert job["global_step"] == job["scheduled_steps"] == 40
    assert job["info"].startswith("ParameterServerStrategy: 2 worker(s)")
    assert "the chief exited with code 0; stopping the worker and ps tasks" in result.stderr
