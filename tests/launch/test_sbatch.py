"""Tests for `tfdp.launch.sbatch` and `tfdp-launch slurm`: the sbatch script.

(Named apart from `tests/distribute/test_slurm_env.py`, which tests `tfdp.distribute.slurm_env`.)
"""

import shlex
import shutil
import subprocess

import pytest

from tfdp.launch import __main__ as launch_main
from tfdp.launch import sbatch


def _parse(script):
    """Returns ({#SBATCH option: value}, srun argv, all lines) of a batch script."""
    lines = script.splitlines()
    options = {}
    for line in lines:
        if line.startswith("#SBATCH "):
            name, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[name] = value
    srun = [shlex.split(line) for line in lines if line.startswith("srun ")]
    assert len(srun) == 1, script
    return options, srun[0], lines


def test_cli_prints_a_batch_script(capsys):
    code = launch_main.main([
        "slurm", "--nodes", "2", "--ntasks_per_node", "1", "--partition", "gpu", "--time",
        "02:00:00", "--gpus_per_node", "4", "--job_name", "mnist.1", "--",
        "python", "train.py", "--note", "two words", "--glob", "*.txt"])
    assert code == 0
    script = capsys.readouterr().out
    options, srun, lines = _parse(script)
    assert lines[0] == "#!/bin/bash"
    assert options == {"--job-name": "mnist.1", "--nodes": "2", "--ntasks-per-node": "1",
                       "--partition": "gpu", "--time": "02:00:00", "--gpus-per-node": "4"}
    # The #SBATCH lines come before any command (sbatch stops reading them there).
    first_command = next(i for i, line in enumerate(lines)
                         if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert srun == ["srun", "--distribution=block", "--kill-on-bad-exit=1", "python", "train.py",
                    "--note", "two words", "--glob", "*.txt"]
    assert "unset TF_CONFIG" in lines  # tfdp must read Slurm's variables, not a stale TF_CONFIG
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_optional_directives_are_left_out_and_gpus_split_per_task():
    options, _, _ = _parse(sbatch.batch_script(sbatch.plan_job(
        ["python", "t.py"], nodes=1, ntasks_per_node=1)))
    assert options == {"--job-name": "tfdp", "--nodes": "1", "--ntasks-per-node": "1"}
    options, _, _ = _parse(sbatch.batch_script(sbatch.plan_job(
        ["python", "t.py"], nodes=3, ntasks_per_node=4, gpus_per_node=8)))
    assert options["--gpus-per-task"] == "2" and "--gpus-per-node" not in options


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--nodes", "0", "--ntasks_per_node", "1"], "`nodes` must be a positive integer. Received: nodes=0"),
        (["--nodes", "1", "--ntasks_per_node", "0"], "`ntasks_per_node` must be a positive integer"),
        (["--nodes", "1", "--ntasks_per_node", "1", "--gpus_per_node", "-1"],
         "`gpus_per_node` must be an integer >= 0"),
        (["--nodes", "1", "--ntasks_per_node", "3", "--gpus_per_node", "4"],
         "`gpus_per_node` must be a multiple of `ntasks_per_node`"),
        (["--nodes", "1", "--ntasks_per_node", "1", "--time", "2 hours"],
         "`time` must be a Slurm time limit"),
        (["--nodes", "1", "--ntasks_per_node", "1", "--job_name", "my job"],
         "`job_name` must be letters, digits"),
        (["--nodes", "1", "--ntasks_per_node", "1", "--partition", "gpu\n#SBATCH --x"],
         "`partition` must be a partition name"),
    ],
)
def test_cli_rejects_bad_job_arguments(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        launch_main.main(["slurm", *argv, "--", "python", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "usage: tfdp-launch slurm --nodes M" in err


@pytest.mark.parametrize("argv,fragment", [
    (["--nodes", "1", "--ntasks_per_node", "1"], "missing COMMAND after `--`"),
    (["--nodes", "1"], "the following arguments are required: --ntasks_per_node"),
])
def test_cli_requires_job_shape_and_command(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        launch_main.main(["slurm", *argv])
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("time", ["90", "30:00", "02:00:00", "1-12", "1-12:30",
                                  "2-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(time):
    assert sbatch.plan_job(["python"], nodes=1, ntasks_per_node=1, time=time).time == time


def test_submit_pipes_the_script_to_sbatch(tmp_path, monkeypatch, capsys):
    captured = tmp_path / "submitted.sbatch"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ncat > {captured}\necho 'Submitted batch job 42'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    code = launch_main.main(["slurm", "--nodes", "2", "--ntasks_per_node", "2", "--submit",
                             "--", "python", "train.py"])
    assert code == 0
    assert capsys.readouterr().out == "Submitted batch job 42\n"
    options, srun, _ = _parse(captured.read_text())
    assert options["--nodes"] == "2" and srun[-2:] == ["python", "train.py"]


def test_submit_without_sbatch_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        launch_main.main(["slurm", "--nodes", "1", "--ntasks_per_node", "1", "--submit",
                          "--", "python", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "`--submit` needs Slurm's `sbatch` on PATH" in err
    assert "leave out --submit and save the script" in err


def test_gpus_per_task_comes_with_ntasks():
    # Current Slurm rejects --gpus-per-task without a task count.
    options, _, _ = _parse(sbatch.batch_script(sbatch.plan_job(
        ["python", "t.py"], nodes=2, ntasks_per_node=4, gpus_per_node=8)))
    assert options["--ntasks"] == "8" and options["--gpus-per-task"] == "2"
    options, _, _ = _parse(sbatch.batch_script(sbatch.plan_job(
        ["python", "t.py"], nodes=2, ntasks_per_node=1, gpus_per_node=8)))
    assert "--ntasks" not in options and options["--gpus-per-node"] == "8"


@pytest.mark.parametrize("argv,expected", [
    (["--cpus_per_task", "4"], {"--cpus-per-task": "4"}),
    (["--mem", "32g"], {"--mem": "32G"}),
    (["--mem", "64000"], {"--mem": "64000"}),
    (["--account", "proj_01"], {"--account": "proj_01"}),
    (["--partition", "gpu,gpu-long"], {"--partition": "gpu,gpu-long"}),
    (["--output", "logs/%x-%j.out"], {"--output": "logs/%x-%j.out"}),
    (["--signal", "TERM@120"], {"--signal": "TERM@120"}),
    (["--signal", "R:SIGTERM@90", "--time", "10"], {"--signal": "R:TERM@90", "--time": "10"}),
    (["--signal", "15"], {"--signal": "TERM"}),
    (["--requeue"], {"--requeue": "", "--open-mode": "append"}),
])
def test_cli_writes_each_new_option(argv, expected, capsys):
    assert launch_main.main(["slurm", "--nodes", "1", "--ntasks_per_node", "2", *argv,
                             "--", "python", "train.py"]) == 0
    options, _, _ = _parse(capsys.readouterr().out)
    base = {"--job-name": "tfdp", "--nodes": "1", "--ntasks-per-node": "2"}
    assert options == {**base, **expected}


def test_cpus_per_task_is_given_to_srun_too():
    # srun does not inherit sbatch's --cpus-per-task on Slurm 22.05-23.02.
    _, srun, _ = _parse(sbatch.batch_script(sbatch.plan_job(
        ["python", "t.py"], nodes=1, ntasks_per_node=2, cpus_per_task=3)))
    assert srun[:4] == ["srun", "--distribution=block", "--kill-on-bad-exit=1",
                        "--cpus-per-task=3"]


@pytest.mark.parametrize("flags", [{"requeue": True}, {"signal": "TERM@60"}])
def test_preemption_lets_every_worker_exit_before_srun_ends_the_step(flags):
    # The first worker to exit 42 must not make srun terminate the others (the chief
    # may still be writing its save) and turn the step's status into theirs.
    _, srun, _ = _parse(sbatch.batch_script(sbatch.plan_job(
        ["python", "t.py"], nodes=1, ntasks_per_node=2, **flags)))
    assert srun[:4] == ["srun", "--distribution=block", "--kill-on-bad-exit=0",
                        f"--wait={sbatch.PREEMPTION_EXIT_WAIT}"]


def test_setup_line_runs_before_srun(capsys):
    assert launch_main.main(["slurm", "--nodes", "1", "--ntasks_per_node", "1", "--setup",
                             "source venv/bin/activate", "--", "python", "train.py"]) == 0
    script = capsys.readouterr().out
    lines = script.splitlines()
    setup = lines.index("source venv/bin/activate")
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert setup < srun
    assert lines[setup - 1] == "set -eo pipefail" and lines[setup + 1] == "set -u"
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def _run_script(tmp_path, script, srun_status):
    """Runs `script` with stand-ins for srun (exiting `srun_status`) and scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f"exit {srun_status}"),
                       ("scontrol", f'echo "$@" >> {tmp_path}/scontrol.log')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77"}
    result = subprocess.run(["bash"], input=script, text=True, capture_output=True, env=env,
                            timeout=30)
    log = tmp_path / "scontrol.log"
    return result, log.read_text() if log.exists() else ""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("srun_status,requeued", [(42, True), (0, False), (1, False)])
def test_requeue_script_requeues_on_exit_42_only(tmp_path, srun_status, requeued):
    script = sbatch.batch_script(sbatch.plan_job(["python", "t.py"], nodes=1, ntasks_per_node=2,
                                                 requeue=True))
    result, scontrol = _run_script(tmp_path, script, srun_status)
    assert result.returncode == srun_status
    assert scontrol == ("requeue 77\n" if requeued else ""), result.stderr
    if requeued:
        assert "workers saved after SIGTERM (exit 42); requeueing job 77" in result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_without_requeue_does_not_requeue(tmp_path):
    script = sbatch.batch_script(sbatch.plan_job(["python", "t.py"], nodes=1, ntasks_per_node=2))
    result, scontrol = _run_script(tmp_path, script, 42)
    assert result.returncode == 42 and scontrol == ""


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--cpus_per_task", "0"], "`cpus_per_task` must be a positive integer"),
        (["--mem", "32 GB"], "`mem` must be memory per node"),
        (["--mem", "lots"], "`mem` must be memory per node"),
        (["--account", "a b"], "`account` must be one account name"),
        (["--output", "my logs/%j.out"], "`output` must not contain whitespace"),
        (["--output", ""], "`output` must be a file name pattern"),
        (["--signal", "USR1@60"], "`signal` must send SIGTERM"),
        (["--signal", "B:TERM@60"], "`signal` must not use 'B:'"),
        (["--signal", "TERM@later"], "`signal` must be sbatch's [R:]SIG[@SECONDS]"),
        (["--signal", "TERM@600", "--time", "5"],
         "`signal` asks for SIGTERM 600 s before the time limit, but `time` is 5 (300 s)"),
        (["--setup", "source a\nsource b"], "`setup` must be one shell command"),
        (["--ntasks_per_node", "2", "--gpus_per_node", "3"],
         "`gpus_per_node` must be a multiple of `ntasks_per_node`"),
        (["--gpus-per-task", "1"], "unrecognized arguments before `--`: --gpus-per-task"),
        (["--qos", "high"], "unrecognized arguments before `--`: --qos"),
    ],
)
def test_cli_refuses_bad_or_contradictory_options_before_writing(argv, fragment, tmp_path,
                                                                 monkeypatch, capsys):
    # Even with --submit nothing reaches sbatch: it would record the script.
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/sh\ncat > {tmp_path}/submitted\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    shape = [] if "--ntasks_per_node" in argv else ["--ntasks_per_node", "1"]
    with pytest.raises(SystemExit) as info:
        launch_main.main(["slurm", "--nodes", "1", *shape, *argv, "--submit", "--",
                          "python", "train.py"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert fragment in captured.err
    assert not (tmp_path / "submitted").exists()
