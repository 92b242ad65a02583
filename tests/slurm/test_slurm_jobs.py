"""`tfdp-launch slurm --submit` on a real one-node Slurm cluster, end to end.

The `slurm` fixture (`conftest.py`) runs slurmctld, slurmd and munged; every
job here is the script `tfdp-launch slurm --nodes 1 --ntasks_per_node 2`
writes, submitted with `--submit`, running `tfdp-train` (the time-limit test:
`time_limit_job.py`, a paced `model.fit`) as two Slurm tasks (two
MultiWorkerMirroredStrategy workers). Each wait is bounded: a job that does
not end in time fails its test and is cancelled.

The measured times (job wall time, signal to requeue to resume) are printed;
run with `-s` to see them.
"""

import json
import re
import shutil
import sys
import time

import numpy as np
import pytest

import slurm_cluster

#: tfdp-train's flags for the full and the preempted run (the same, so that
#: their weights can be compared): 3 epochs x 22 steps of the MLP on the bundled
#: digits, a progress line every 5 steps. Not the CNN: its dropout draws are not
#: part of the saved state, so a resumed CNN run takes other dropout masks and
#: ends with other weights (measured with tfdp-launch too; reported).
TRAIN_FLAGS = ("--dataset=digits", "--model=mlp", "--epochs=3", "--noeval", "--log_every=5",
               "--steps_per_loop=1")
TOTAL_STEPS = 66
#: Seconds a two-worker tfdp-train job may take before it counts as hung (65-95 s
#: on 2 CPUs shared with other work; as in tests/app/test_train_e2e.py).
JOB_TIMEOUT = 420.0


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


def _output(workdir, job_id, name="slurm-{job_id}.out"):
    path = workdir / name.format(job_id=job_id)
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def _wait_for_output(slurm, workdir, job_id, name, text, *, timeout):
    """Waits until the job's output file holds `text`; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while text not in _output(workdir, job_id, name):
        job = slurm.job(job_id)
        assert job.get("JobState") not in slurm_cluster.FINAL_STATES, (
            f"job {job_id} ended ({job.get('JobState')}) before printing {text!r}:\n"
            + _output(workdir, job_id, name)[-3000:])
        assert time.monotonic() < deadline, (
            f"job {job_id} printed no {text!r} in {timeout:g} s:\n"
            + _output(workdir, job_id, name)[-3000:])
        time.sleep(0.25)


def _weights(model_dir):
    """{variable: value} of the run's final checkpoint in `model_dir`."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(model_dir))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "/.ATTRIBUTES/VARIABLE_VALUE" in name
            and not name.startswith(("save_counter", "checkpointed_runs"))}  # bookkeeping


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


@pytest.fixture(scope="module")
def preempted_run(slurm, data_dir, tmp_path_factory):
    """The same run, SIGTERMed at step 5 and requeued: (model_dir, job fields, output).

    SIGTERM goes as Slurm sends it before a time limit (`#SBATCH --signal=TERM@S`)
    or on `scancel --signal=TERM`: to the tasks, not to the batch shell and srun.
    """
    workdir = tmp_path_factory.mktemp("preempted")
    out = "job-{job_id}.out"
    submitted = []
    try:
        job_id = _submit(slurm, submitted, workdir, workdir / "run", data_dir,
                         launch_flags=("--requeue", "--output", str(workdir / "job-%j.out")))
        _wait_for_output(slurm, workdir, job_id, out, "tfdp-train: step 5/",
                         timeout=JOB_TIMEOUT)
        signalled = time.monotonic()
        slurm.run(["scancel", "--signal=TERM", str(job_id)])
        slurm.wait_job(job_id, timeout=120, until=lambda job: int(job.get("Restarts", 0)) >= 1)
        requeued = time.monotonic()
        job = slurm.wait_job(job_id, timeout=30, until=lambda job: job["JobState"] == "PENDING")
        held = job["EligibleTime"]
        # Slurm holds a requeued job ~2 minutes (EligibleTime); start it now instead. Not
        # in the requeue's own second: slurmd refuses credentials dated before their
        # revocation ("Job credential revoked").
        time.sleep(2)
        slurm.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
        slurm.wait_job(job_id, timeout=60, until=lambda job: job["JobState"] != "PENDING")
        resumed = time.monotonic()
        job = slurm.wait_job(job_id, timeout=JOB_TIMEOUT)
        ended = time.monotonic()
        print(f"\n[slurm] preempted run: job {job_id}: SIGTERM to requeue "
              f"{requeued - signalled:.1f} s (Slurm would hold it until {held}); requeue to "
              f"running again {resumed - requeued:.1f} s; rerun {ended - resumed:.1f} s; "
              f"{job['JobState']}")
        yield workdir / "run", job, _output(workdir, job_id, out)
    finally:
        for job_id in submitted:
            slurm.run(["scancel", "--full", str(job_id)], check=False)


@pytest.mark.slow
def test_preempted_job_saves_requeues_and_resumes_to_the_planned_steps(preempted_run):
    model_dir, job, output = preempted_run
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-4000:]
    assert job["Restarts"] == "1", output[-4000:]
    # Every worker saved and exited 42; the script requeued the job.
    assert output.count("saved after SIGTERM; exiting with code 42") == 2, output[-4000:]
    assert "Exited with exit code 42" in output
    assert f"[tfdp] workers saved after SIGTERM (exit 42); requeueing job {job['JobId']}" in output
    before_requeue, after_requeue = output.split("requeueing job", 1)
    # The last save before the requeue is the one SIGTERM triggered; an epoch-end save can
    # come before it when the workers pass an epoch boundary before the signal lands.
    saved = re.findall(r"saved \S+/backup/ckpt-\d+ \(epoch \d+, batch \d+, step (\d+)\)",
                       before_requeue)
    assert saved and 0 < int(saved[-1]) < TOTAL_STEPS, output[-4000:]
    # The rerun resumed from the saved step, not from step 0, and finished the plan.
    resumed = re.search(r"resumed from \S+ at .*\(step (\d+)\)", after_requeue)
    assert resumed and int(resumed.group(1)) == int(saved[-1]), output[-4000:]
    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["strategy"]["num_workers"] == 2


@pytest.mark.slow
def test_preempted_job_ends_with_the_uninterrupted_runs_weights(preempted_run, full_run):
    model_dir, job, output = preempted_run
    full_dir, full_job, full_output = full_run
    assert job["JobState"] == "COMPLETED", output[-3000:]
    assert full_job["JobState"] == "COMPLETED", full_output[-3000:]
    expected, actual = _weights(full_dir), _weights(model_dir)
    assert sorted(actual) == sorted(expected)
    differ = {name: float(np.max(np.abs(actual[name] - value)))
              for name, value in expected.items()
              if not np.allclose(actual[name], value, atol=1e-5, rtol=0)}
    assert not differ, f"variables differing from the uninterrupted run (max |diff|): {differ}"


@pytest.mark.slow
def test_tasks_with_different_flags_fail_with_the_mismatch_message(slurm, jobs, data_dir,
                                                                   tmp_path):
    # Each task adds its rank to --seed: the workers must refuse, not hang in a collective.
    out = "job-{job_id}.out"
    train = " ".join([shutil.which("tfdp-train"), *TRAIN_FLAGS, f"--data_dir={data_dir}",
                      f"--model_dir={tmp_path / 'run'}"])
    command = [sys.executable, "-m", "tfdp.launch", "slurm", "--nodes", "1",
               "--ntasks_per_node", "2", "--output", str(tmp_path / "job-%j.out"), "--submit",
               "--", "bash", "-c", f"exec {train} --seed=$((7 + SLURM_PROCID))"]
    result = slurm.run(command, cwd=tmp_path)
    job_id = int(re.fullmatch(r"Submitted batch job (\d+)\n", result.stdout).group(1))
    jobs.append(job_id)
    began = time.monotonic()
    job = slurm.wait_job(job_id, timeout=JOB_TIMEOUT)
    output = _output(tmp_path, job_id, out)
    print(f"\n[slurm] mismatched flags: job {job_id} {job['JobState']} (exit {job['ExitCode']}) "
          f"after {time.monotonic() - began:.1f} s")
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", output[-4000:]
    assert "tfdp-train: error: The workers' configurations differ" in output, output[-4000:]
    assert "worker 1 differs from the chief (worker 0) in: seed" in output, output[-4000:]


#: The time-limit job's SIGTERM lead (`#SBATCH --signal=TERM@120`).
SIGNAL_LEAD = 120
#: slurmctld looks at time limits (and sends `--signal`) every 30 s (its PERIODIC_TIMEOUT),
#: up to 30 s before the lead asks for.
LIMIT_CHECK_PERIOD = 30


def _unix_time(stamp):
    """A Slurm time stamp (local time, whole seconds) as a Unix time."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def _started(job):
    """A running job's StartTime (slurmctld's clock) as a Unix time."""
    return _unix_time(job["StartTime"])


@pytest.mark.slow
def test_time_limit_signal_saves_requeues_and_resumes(slurm, jobs, tmp_path):
    # `--signal TERM@120 --time T`: Slurm itself sends SIGTERM to the tasks 120 s
    # before the limit; every worker saves and exits 42, the script requeues,
    # the rerun resumes. Time limits are whole minutes and slurmctld checks them
    # every 30 s, so a limit set at submission would land the signal somewhere in
    # a window of a minute or more, maybe before TensorFlow has started. Instead
    # the job starts with 10 minutes and, once it trains, its limit is lowered
    # (`scontrol update TimeLimit=M`, as a user may) so that the SIGTERM is due
    # at once: Slurm's own check sends it within 30 s.
    import time_limit_job as job_program

    out = "job-{job_id}.out"
    backup_dir, result_path = tmp_path / "backup", tmp_path / "result.npz"
    command = [sys.executable, "-m", "tfdp.launch", "slurm", "--nodes", "1",
               "--ntasks_per_node", "2", "--time", "10", "--signal", f"TERM@{SIGNAL_LEAD}",
               "--requeue", "--output", str(tmp_path / "job-%j.out"), "--submit", "--",
               sys.executable, job_program.__file__, str(backup_dir), str(result_path)]
    result = slurm.run(command, cwd=tmp_path)
    job_id = int(re.fullmatch(r"Submitted batch job (\d+)\n", result.stdout).group(1))
    jobs.append(job_id)
    submitted = time.monotonic()
    _wait_for_output(slurm, tmp_path, job_id, out, "[0] step 3\n", timeout=JOB_TIMEOUT)
    job = slurm.job(job_id)
    assert "#SBATCH --signal=TERM@120" in _script(slurm, job_id)
    elapsed = time.time() - _started(job)
    # Due at once: the limit is between the lead and the lead + one check period away.
    minutes = int((elapsed + SIGNAL_LEAD + LIMIT_CHECK_PERIOD) // 60)
    slurm.run(["scontrol", "update", f"jobid={job_id}", f"TimeLimit={minutes}"])
    lowered, lowered_at = time.monotonic(), time.time()
    _wait_for_output(slurm, tmp_path, job_id, out, "exiting with code 42",
                     timeout=LIMIT_CHECK_PERIOD + 60)
    saved = time.monotonic()
    job = slurm.wait_job(job_id, timeout=120, until=lambda job: int(job.get("Restarts", 0)) >= 1)
    requeued = time.monotonic()
    slurm.wait_job(job_id, timeout=30, until=lambda job: job["JobState"] == "PENDING")
    # Skip Slurm's ~2-minute hold of a requeued job (see the preemption test), and
    # give the rerun time to finish: its limit would otherwise signal it again.
    time.sleep(2)
    slurm.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now", "TimeLimit=10"])
    slurm.wait_job(job_id, timeout=60, until=lambda job: job["JobState"] != "PENDING")
    resumed = time.monotonic()
    job = slurm.wait_job(job_id, timeout=JOB_TIMEOUT)
    ended = time.monotonic()
    output = _output(tmp_path, job_id, out)
    # slurmstepd logs the signal to the step: "*** STEP 1.0 ON node CANCELLED AT <time> ***".
    signalled = re.search(r"STEP \S+ ON \S+ CANCELLED AT (\S+) \*\*\*", output)
    signal_after = ("?" if signalled is None else
                    f"{_unix_time(signalled.group(1)) - lowered_at:.0f}")
    print(f"\n[slurm] time-limit signal: job {job_id}: limit lowered {lowered - submitted:.1f} s "
          f"after submission ({elapsed:.0f} s into the run, to {minutes} min); SIGTERM "
          f"{signal_after} s later (whole seconds); a worker "
          f"saved and exited 42 {saved - lowered:.1f} s after lowering; requeued "
          f"{requeued - lowered:.1f} s after lowering; rerun {ended - resumed:.1f} s; "
          f"{job['JobState']}; test {ended - submitted:.1f} s")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-4000:]
    assert job["Restarts"] == "1", output[-4000:]
    first, rerun = output.split("requeueing job", 1)
    assert first.count("saved after SIGTERM; exiting with code 42") == 2, output[-4000:]
    assert "Exited with exit code 42" in first and "TIME LIMIT" not in first, output[-4000:]
    # The last save of the first run is the SIGTERM's (the others end an epoch).
    saves = re.findall(r"saved \S+/ckpt-\d+ \(epoch \d+, batch \d+, step (\d+)\)", first)
    assert saves, output[-4000:]
    step = int(saves[-1])
    assert 3 <= step < job_program.TOTAL_STEPS, output[-4000:]
    for rank in (0, 1):
        assert f"[{rank}] started at step {step}\n" in rerun, output[-4000:]
        assert f"[{rank}] done at step {job_program.TOTAL_STEPS}\n" in rerun, output[-4000:]
    # ... and ends with the weights of a run that never stopped (the same process
    # trained one after the resumed run: same seed, same strategy, no backup).
    result = np.load(result_path)
    assert int(result["steps"]) == int(result["reference_steps"]) == job_program.TOTAL_STEPS
    weights = sorted(k for k in result.files if k.startswith("weight"))
    assert weights
    for name in weights:
        np.testing.assert_allclose(result[name], result[name.replace("weight", "reference")],
                                   rtol=0, atol=1e-6, err_msg=name)


def _script(slurm, job_id):
    """The batch script Slurm holds for a job."""
    return slurm.run(["scontrol", "write", "batch_script", str(job_id), "-"]).stdout
