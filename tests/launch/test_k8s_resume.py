"""Tests for TFJobs that resume: storage, restart and run policies, exit codes.

- Every manifest round-trips through the Kubeflow Training Operator's own
  models (`kubeflow-training`'s `KubeflowOrgV1TFJob`): a misspelled or
  misplaced field is dropped by them and fails the comparison. Skipped, with
  the reason, when that package is not installed (it is in the `test` extra).
- The restart decision is read from the written manifest and applied, with
  the operator's rule (`tfjob_worker.operator_restarts`), to the exit code of
  the manifest's own container command run here.
"""

import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tfdp.launch import __main__ as launch_main
from tfdp.launch import k8s, tfjob_worker

COMMAND_TIMEOUT = 60


def _write_manifest(tmp_path, argv, command, name="tfjob.yaml"):
    """Runs `tfdp-launch k8s ARGV -- COMMAND` writing to a file; returns the parsed manifest."""
    path = tmp_path / name
    code = launch_main.main(["k8s", "--image", "tfdp", "--workers", "2", *argv,
                             "--output", str(path), "--", *command])
    assert code == 0
    return yaml.safe_load(path.read_text())


def _worker(manifest):
    return manifest["spec"]["tfReplicaSpecs"]["Worker"]


def _container(manifest):
    return _worker(manifest)["template"]["spec"]["containers"][0]


def _kubeflow_round_trip(manifest):
    """`manifest` read into `KubeflowOrgV1TFJob` and written back: (model, dict)."""
    training = pytest.importorskip(
        "kubeflow.training", reason="kubeflow-training is not installed (pip install "
        "kubeflow-training; it is in tfdp's `test` extra): the manifest cannot be checked "
        "against the Training Operator's models")

    class _Response:  # what ApiClient.deserialize reads: a JSON body
        data = json.dumps(manifest)

    client = training.ApiClient()
    job = client.deserialize(_Response(), "KubeflowOrgV1TFJob")
    return job, client.sanitize_for_serialization(job)


# -- the manifest against the operator's models ----------------------------------------

@pytest.mark.parametrize("argv", [
    [],
    ["--restart_policy", "OnFailure", "--backoff_limit", "3"],
    ["--restart_policy", "Never"],
    ["--pvc", "tfdp-runs", "--mount_path", "/mnt/runs", "--gpus_per_worker", "2", "--cpu",
     "8", "--memory", "32Gi", "--clean_pod_policy", "All", "--ttl_seconds_after_finished",
     "3600", "--gang", "--queue", "research", "--grace_period", "120", "--namespace", "ml"],
])
def test_manifest_round_trips_through_the_operators_models(tmp_path, argv):
    manifest = _write_manifest(tmp_path, argv, ["tfdp-train", "--model_dir", "/mnt/runs/a"]
                               if "--pvc" in argv else ["tfdp-train"])
    job, written_back = _kubeflow_round_trip(manifest)
    assert written_back == manifest
    assert type(job).__name__ == "KubeflowOrgV1TFJob"


def test_the_manifest_is_written_without_kubeflow_training(tmp_path):
    # It is an optional extra: `tfdp-launch k8s` must not need it.
    path = tmp_path / "tfjob.yaml"
    program = ("import sys; sys.modules['kubeflow'] = None  # any import of it fails\n"
               "from tfdp.launch import __main__ as launch_main\n"
               f"sys.exit(launch_main.main(['k8s', '--image', 'tfdp', '--workers', '2', "
               f"'--pvc', 'runs', '--output', {str(path)!r}, '--', 'tfdp-train', "
               f"'--model_dir', '/workspace/a']))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert _worker(yaml.safe_load(path.read_text()))["restartPolicy"] == "ExitCode"


def test_a_misplaced_field_fails_the_round_trip(tmp_path):
    manifest = _write_manifest(tmp_path, ["--pvc", "runs"], ["tfdp-train"])
    # `volumes` belongs to the pod spec, not to the container: the models drop it.
    _container(manifest)["volumes"] = _worker(manifest)["template"]["spec"].pop("volumes")
    assert _kubeflow_round_trip(manifest)[1] != manifest
    misspelled = _write_manifest(tmp_path, [], ["tfdp-train"], name="b.yaml")
    misspelled["spec"]["runPolicy"]["backOffLimit"] = misspelled["spec"]["runPolicy"].pop(
        "backoffLimit")
    assert _kubeflow_round_trip(misspelled)[1] != misspelled


def test_volume_mount_and_policies_are_where_the_operator_reads_them(tmp_path):
    manifest = _write_manifest(
        tmp_path, ["--pvc", "tfdp-runs", "--backoff_limit", "4", "--ttl_seconds_after_finished",
                   "600", "--gang", "--grace_period", "90"],
        ["tfdp-train", "--model_dir=/workspace/runs/mlp"])
    job, _ = _kubeflow_round_trip(manifest)
    worker = job.spec.tf_replica_specs["Worker"]
    assert worker.replicas == 2
    assert worker.restart_policy == "ExitCode"
    pod = worker.template.spec
    assert [(v.name, v.persistent_volume_claim.claim_name) for v in pod.volumes] == [
        ("tfdp-storage", "tfdp-runs")]
    container = pod.containers[0]
    assert container.name == "tensorflow"
    assert [(m.name, m.mount_path) for m in container.volume_mounts] == [
        ("tfdp-storage", "/workspace")]
    assert container.command + container.args == [
        "tfdp-launch", "tfjob-worker", "--", "tfdp-train", "--model_dir=/workspace/runs/mlp"]
    assert pod.termination_grace_period_seconds == 90
    policy = job.spec.run_policy
    assert (policy.backoff_limit, policy.clean_pod_policy, policy.ttl_seconds_after_finished) == (
        4, "Running", 600)
    assert policy.scheduling_policy.min_available == 2


# -- restarts: the manifest's policy applied to its container's exit code -----------------

def _run_container(manifest, *, env=None):
    """Runs the manifest's container command here; returns its exit code."""
    container = _container(manifest)
    done = subprocess.run(container["command"] + container["args"], capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT, env=env)
    return done.returncode, done.stderr


@pytest.mark.parametrize("worker_exit,container_exit,restarted", [
    (0, 0, False),
    (2, 2, False),       # configuration error: permanent
    (1, 1, False),       # any other error: permanent
    (42, 138, True),     # preempted and saved: retryable
    (43, 138, True),     # a peer worker was lost: retryable
])
def test_exit_code_policy_restarts_preemption_and_not_configuration_errors(
        tmp_path, worker_exit, container_exit, restarted):
    manifest = _write_manifest(
        tmp_path, [], [sys.executable, "-c", f"import sys; sys.exit({worker_exit})"])
    code, _ = _run_container(manifest)
    assert code == container_exit
    assert tfjob_worker.operator_restarts(_worker(manifest)["restartPolicy"], code) is restarted


def test_on_failure_policy_restarts_configuration_errors_too(tmp_path):
    manifest = _write_manifest(tmp_path, ["--restart_policy", "OnFailure"],
                               [sys.executable, "-c", "import sys; sys.exit(2)"])
    code, _ = _run_container(manifest)
    assert code == 2
    assert tfjob_worker.operator_restarts(_worker(manifest)["restartPolicy"], code) is True


def test_a_worker_killed_by_sigkill_is_restarted(tmp_path):
    manifest = _write_manifest(tmp_path, [], [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    code, err = _run_container(manifest)
    assert code == 137
    assert "killed by SIGKILL; exiting 137" in err
    assert tfjob_worker.operator_restarts("ExitCode", code) is True


def test_sigterm_to_the_container_reaches_the_worker_which_saves_and_is_restarted(tmp_path):
    ready, saved = tmp_path / "ready", tmp_path / "saved"
    worker = (
        "import signal, sys, time\n"
        "def on_term(signum, frame):\n"
        f"    open({str(saved)!r}, 'w').write('saved')\n"
        "    sys.exit(42)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(60)\n")
    manifest = _write_manifest(tmp_path, [], [sys.executable, "-c", worker])
    container = _container(manifest)
    process = subprocess.Popen(container["command"] + container["args"],
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)  # the kubelet signals the container's PID 1
        _, err = process.communicate(timeout=COMMAND_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert saved.read_text() == "saved"
    assert process.returncode == tfjob_worker.OPERATOR_USER_RETRYABLE
    assert "was preempted and saved its state (exit 42); exiting 138" in err
    assert tfjob_worker.operator_restarts(_worker(manifest)["restartPolicy"],
                                          process.returncode) is True


@pytest.mark.parametrize("policy,code,restarted", [
    ("ExitCode", 143, True), ("ExitCode", 130, True), ("ExitCode", 139, False),
    ("ExitCode", 127, False), ("Never", 138, False), ("OnFailure", 1, True),
    ("OnFailure", 0, False), ("Always", 0, True),
])
def test_operator_rule(policy, code, restarted):
    assert tfjob_worker.operator_restarts(policy, code) is restarted


def test_container_exit_codes():
    assert [tfjob_worker.container_exit_code(c) for c in (0, 1, 2, 42, 43, -9, -15, 143)] == [
        0, 1, 2, 138, 138, 137, 143, 143]


def test_tfjob_worker_cannot_start_a_missing_program(capsys):
    assert launch_main.main(["tfjob-worker", "--", "/nonexistent/tfdp-program"]) == 127
    assert "cannot start '/nonexistent/tfdp-program'" in capsys.readouterr().err


# -- refusals: exit 2, one line, nothing written ------------------------------------------

@pytest.mark.parametrize("argv,command,fragment", [
    (["--pvc", "runs"], ["tfdp-train", "--model_dir", "/tmp/run"],
     "--model_dir /tmp/run is outside the volume mounted at /workspace (--pvc runs), so a "
     "restarted pod could not resume from it. Give an absolute --model_dir under /workspace"),
    (["--pvc", "runs"], ["tfdp-train", "--model_dir=/workspace/../etc/run"],
     "is outside the volume mounted at /workspace"),
    (["--pvc", "runs"], ["tfdp-train", "--model_dir", "runs/a"],
     "--model_dir runs/a is outside the volume"),
    ([], ["tfdp-train", "--model_dir", "/workspace/run"],
     "--model_dir /workspace/run is in the container's own filesystem, which a restarted pod "
     "does not keep, so --restart_policy ExitCode could not resume from it. Mount a "
     "PersistentVolumeClaim with --pvc NAME"),
    (["--restart_policy", "OnFailure"], ["tfdp-train", "-model_dir", "/r"],
     "--restart_policy OnFailure could not resume"),
    (["--pvc", "Bad_Name"], ["tfdp-train"], "`pvc` must name a PersistentVolumeClaim"),
    (["--pvc", "runs", "--mount_path", "/"], ["tfdp-train"],
     "`mount_path` must be an absolute directory path other than '/'"),
    (["--pvc", "runs", "--mount_path", "work"], ["tfdp-train"], "Received: mount_path='work'"),
    (["--queue", "q"], ["tfdp-train"], "give it with gang=True (--gang)"),
    (["--backoff_limit", "-1"], ["tfdp-train"], "`backoff_limit` must be an integer >= 0"),
    (["--ttl_seconds_after_finished", "-5"], ["tfdp-train"],
     "`ttl_seconds_after_finished` must be an integer >= 0"),
    (["--restart_policy", "Always"], ["tfdp-train"], "argument --restart_policy: invalid choice"),
])
def test_cli_refuses_and_writes_nothing(tmp_path, capsys, argv, command, fragment):
    path = tmp_path / "tfjob.yaml"
    path.write_text("# an earlier manifest\n")
    with pytest.raises(SystemExit) as info:
        launch_main.main(["k8s", "--image", "tfdp", "--workers", "2", *argv,
                          "--output", str(path), "--", *command])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err
    assert path.read_text() == "# an earlier manifest\n"


@pytest.mark.parametrize("argv,command", [
    (["--restart_policy", "Never"], ["tfdp-train", "--model_dir", "/tmp/run"]),
    ([], ["tfdp-train", "--model_dir", "gs://bucket/runs/a"]),
    (["--pvc", "runs", "--mount_path", "/mnt/data/"], ["tfdp-train", "--model_dir",
                                                        "/mnt/data/runs/a"]),
    (["--pvc", "runs"], ["tfdp-train", "--model_dir", "/workspace"]),
    # After a bare `--` nothing is a flag of the program.
    (["--pvc", "runs"], ["python", "train.py", "--", "--model_dir", "/tmp/x"]),
])
def test_model_dirs_a_restarted_pod_finds_are_accepted(tmp_path, argv, command):
    _write_manifest(tmp_path, argv, command)


def test_restarts_without_storage_warn(tmp_path, capsys):
    _write_manifest(tmp_path, [], ["tfdp-train"])
    assert ("[launch] warning: no --pvc: with --restart_policy ExitCode a restarted worker "
            "starts with a new container filesystem") in capsys.readouterr().err
    _write_manifest(tmp_path, ["--restart_policy", "Never"], ["tfdp-train"])
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("command,model_dir", [
    (["p", "--model_dir", "/a"], "/a"),
    (["p", "--model_dir=/a", "--model_dir", "/b"], "/b"),
    (["p", "-model_dir=/c"], "/c"),
    (["p", "--model_dir_x", "/a"], None),
    (["p", "--", "--model_dir", "/a"], None),
    (["p", "--model_dir"], None),
])
def test_model_dir_of_reads_flags_as_absl_does(command, model_dir):
    assert k8s.model_dir_of(command) == model_dir


def test_tfjob_worker_is_on_path_as_the_manifest_expects():
    # The container command is `tfdp-launch tfjob-worker -- ...`: the console script
    # must answer (it is what an image with tfdp installed has).
    done = subprocess.run(["tfdp-launch", "tfjob-worker", "--help"], capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT, env=dict(os.environ))
    assert done.returncode == 0
    assert ("42 (preempted, state saved) and 43 (a peer worker was lost) become 138"
            in " ".join(done.stdout.split()))


# -- a killed worker pod: its peers are retried too, and the job resumes -------------------

class _Operator:
    """The Training Operator's worker loop, here: one process per worker "container".

    Runs the manifest's container command for every worker with the TF_CONFIG
    the operator would give it (addresses stay the same across re-creations,
    as a pod's service name does), and re-creates a container that exits
    with a code its replica's `restartPolicy` retries (`operator_restarts`).
    Every process carries a marker variable so the test can check that none
    is left behind.
    """

    def __init__(self, manifest, out_dir, *, restart_delay=1.0):
        from multiworker import _environment, free_port_pair

        port = free_port_pair()
        self.addresses = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
        self.policy = _worker(manifest)["restartPolicy"]
        container = _container(manifest)
        self.command = container["command"] + container["args"]
        self.token = f"k8s-{os.getpid()}-{time.monotonic_ns()}"
        self.environ = _environment({"PYTHONUNBUFFERED": "1"}, self.token)
        self.out_dir = out_dir
        self.restart_delay = restart_delay
        self.running = {}          # index -> Popen
        self.incarnation = [0] * len(self.addresses)
        self.exits = []            # (index, incarnation, container exit code, seconds)
        self.started = time.monotonic()

    def start(self, index):
        tf_config = {"cluster": {"worker": self.addresses},
                     "task": {"type": "worker", "index": index}}
        log = open(self.log_path(index, self.incarnation[index]), "wb")
        with log:
            self.running[index] = subprocess.Popen(
                self.command, env={**self.environ, "TF_CONFIG": json.dumps(tf_config)},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_path(self, index, incarnation):
        return self.out_dir / f"worker-{index}-{incarnation}.log"

    def program_pid(self, index):
        """The pid of the program `tfdp-launch tfjob-worker` runs in container `index`."""
        pid = self.running[index].pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        assert len(children) == 1, (pid, children)
        return int(children[0])

    def run(self, *, until, timeout):
        """Supervises the containers until every worker exits 0; returns False if the job failed."""
        due = {}
        deadline = time.monotonic() + timeout
        while self.running or due:
            until()
            for index, process in list(self.running.items()):
                if process.poll() is None:
                    continue
                del self.running[index]
                code = process.returncode
                self.exits.append((index, self.incarnation[index], code,
                                   time.monotonic() - self.started))
                if code != 0 and not tfjob_worker.operator_restarts(self.policy, code):
                    return False  # a permanent failure fails the TFJob
                if code != 0:
                    self.incarnation[index] += 1
                    due[index] = time.monotonic() + self.restart_delay
            for index, when in list(due.items()):
                if time.monotonic() >= when:
                    del due[index]
                    self.start(index)
            assert time.monotonic() < deadline, f"the job did not finish: {self.exits}"
            time.sleep(0.1)
        return True

    def stop(self):
        """SIGKILLs and reaps every container left; returns the other marked processes.

        Those (none, unless a container left its program behind) are SIGKILLed too.
        """
        from multiworker import marked_processes

        for process in self.running.values():
            process.kill()
            process.wait()
        leftovers = marked_processes(self.token)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leftovers

    def output(self):
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.out_dir.glob("worker-*.log")))


@pytest.mark.slow
def test_a_killed_worker_pod_and_its_peers_are_retried_and_the_job_resumes(tmp_path):
    # One worker's program is SIGKILLed (an OOM kill) mid-run: its container
    # exits 137, the survivor's collectives fail and it exits 43 (a lost peer),
    # which its container reports as 138. Both are retryable under the
    # manifest's policy, so every worker is re-created and the job resumes
    # from the volume instead of failing.
    run_dir = tmp_path / "volume" / "run"
    epochs, steps_per_epoch = 2, 22  # digits: 1437 examples, global batch 64
    manifest = _write_manifest(
        tmp_path, ["--pvc", "runs", "--mount_path", str(tmp_path / "volume")],
        ["tfdp-train", "--dataset", "digits", "--model", "mlp", "--epochs", str(epochs),
         "--model_dir", str(run_dir), "--checkpoint_every", "5", "--noeval"])
    assert _worker(manifest)["restartPolicy"] == "ExitCode"
    operator = _Operator(manifest, tmp_path)
    killed = []

    def kill_worker_1_after_its_first_backup():
        if not killed and any(run_dir.glob("backup/ckpt-*.index")):
            os.kill(operator.program_pid(1), signal.SIGKILL)
            killed.append(time.monotonic() - operator.started)

    try:
        operator.start(0)
        operator.start(1)
        succeeded = operator.run(until=kill_worker_1_after_its_first_backup, timeout=420)
    finally:
        leftovers = operator.stop()
    described = f"exits (worker, incarnation, code, s): {operator.exits}\n{operator.output()}"
    assert killed, described
    assert succeeded, described
    assert not leftovers, f"processes left behind: {leftovers}\n{described}"
    first = {(index, incarnation): code for index, incarnation, code, _ in operator.exits}
    assert first[(1, 0)] == 137, described
    assert first[(0, 0)] == tfjob_worker.OPERATOR_USER_RETRYABLE, described
    survivor = operator.log_path(0, 0).read_text()
    assert "lost a peer worker (exit 43); exiting 138" in survivor, described
    assert "Worker 1 (" in survivor, described  # the message names the lost peer
    # The last incarnations resumed from the volume and finished the planned steps.
    last = operator.log_path(0, operator.incarnation[0]).read_text()
    resumed = re.search(r"resumed from \S+ at epoch \d+, batch \d+ \(step (\d+)\)", last)
    assert resumed and int(resumed.group(1)) > 0, described
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == epochs * steps_per_epoch
    survivor_exit = next(t for i, n, _, t in operator.exits if (i, n) == (0, 0))
    print(f"\nSIGKILL at {killed[0]:.1f} s; survivor exited 138 {survivor_exit - killed[0]:.1f} s "
          f"later; exits {operator.exits}; resumed at step {resumed.group(1)}; job done at "
          f"{operator.exits[-1][3]:.1f} s")
