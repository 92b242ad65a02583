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
