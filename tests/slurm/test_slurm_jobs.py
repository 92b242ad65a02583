"""`tfdp-launch slurm --submit` on a real one-node Slurm cluster, end to end.

The `slurm` fixture (`conftest.py`) runs slurmctld, slurmd and munged; every
job here is the script `tfdp-launch slurm --nodes 1 --ntasks_per_node 2`
writes, submitted with `--submit`, running `tfdp-train` as two Slurm tasks
(two MultiWorkerMirroredStrategy workers). Each wait is bounded: a job that
does not end in time fails its test and is cancelled.

The measured times (job wall time, requeue to resume) are printed; run with
`-s` to see them.
"""

import json
import re
import shutil
import sys
import time

import pytest

#: tfdp-train's flags for the full and the preempted run (the same, so that
#: their weights can be compared): 3 epochs x 22 steps of the small CNN on the
#: bundled digits, a progress line every 5 steps.
TRAIN_FLAGS = ("--dataset=digits", "--model=cnn", "--epochs=3", "--noeval", "--log_every=5",
               "--steps_per_loop=1")
TOTAL_STEPS = 66
#: Seconds a two-worker tfdp-train job may take (about 50 s on 2 CPUs).
JOB_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared copy of digits for every job of this module (the first job writes it)."""
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture
def jobs(slurm):
    """Submitted job ids; any still running when the test ends is cancelled."""
    submitted = []
    yield submitted
    for job_id in submitted:
        slurm.run(["scancel", "--full", str(job_id)], check=False)
    for job_id in submitted:
        try:
            slurm.wait_job(job_id, timeout=60)
        except TimeoutError:
            pass


def _submit(slurm, jobs, workdir, model_dir, data_dir, *, launch_flags=(),
            train_flags=TRAIN_FLAGS):
    """`tfdp-launch slurm --submit ... -- tfdp-train ...`; returns the job id."""
    command = [sys.executable, "-m", "tfdp.launch", "slurm", "--nodes", "1",
               "--ntasks_per_node", "2", *launch_flags, "--submit", "--",
               shutil.which("tfdp-train"), f"--model_dir={model_dir}",
               f"--data_dir={data_dir}", *train_flags]
    result = slurm.run(command, cwd=workdir, check=False)
    assert result.returncode == 0, result.stderr
    match = re.fullmatch(r"Submitted batch job (\d+)\n", result.stdout)
    assert match, result.stdout
    jobs.append(int(match.group(1)))
    return int(match.group(1))


def _output(workdir, job_id):
    path = workdir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def _wall_seconds(job):
    """A finished job's run time from `scontrol show job` (RunTime, H:MM:SS)."""
    days, _, clock = job["RunTime"].rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


@pytest.fixture(scope="module")
def full_run(slurm, data_dir, tmp_path_factory):
    """One uninterrupted two-worker run: (model_dir, job fields, output)."""
    workdir = tmp_path_factory.mktemp("full")
    submitted = []
    try:
        job_id = _submit(slurm, submitted, workdir, workdir / "run", data_dir)
        began = time.monotonic()
        job = slurm.wait_job(job_id, timeout=JOB_TIMEOUT)
        print(f"\n[slurm] full run: job {job_id} {job['JobState']} after "
              f"{time.monotonic() - began:.1f} s from submission (RunTime {job['RunTime']})")
        yield workdir / "run", job, _output(workdir, job_id)
    finally:
        for job_id in submitted:
            slurm.run(["scancel", "--full", str(job_id)], check=False)


@pytest.mark.slow
def test_submitted_job_trains_two_workers_to_completion(full_run):
    model_dir, job, output = full_run
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-3000:]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["strategy"]["num_workers"] == 2
    assert summary["strategy"]["strategy"] == "MultiWorkerMirroredStrategy"
    assert summary["steps"] == TOTAL_STEPS
    assert f"tfdp-train: {TOTAL_STEPS} steps" in output
