"""Kubernetes manifests for tfdp jobs: `tfdp-launch k8s ...`.

This module owns one translation: a job description (image, worker count,
resources, storage, restart and run policies) and the command every worker
runs, into a Kubeflow `TFJob` manifest (`kubeflow.org/v1`, served by the
Kubeflow Training Operator). The operator creates one pod and one service per
worker and sets each pod's TF_CONFIG (`{"cluster": {"worker": [...]}, "task":
{"type": "worker", "index": i}}`, port 2222), which `tfdp.make_strategy()`
reads: worker 0 is the chief. It does not talk to a cluster; apply the
manifest with `kubectl apply -f`. The field names are the operator's own
(`kubeflow-training`'s `KubeflowOrgV1TFJob` model; the tests round-trip every
manifest through it), but that package is not needed to write one.

Resuming. A restarted pod starts with a fresh container filesystem, so it
resumes only from a `--model_dir` on storage every pod mounts: `--pvc NAME`
mounts that PersistentVolumeClaim at `--mount_path` (default `/workspace`) in
every worker, and with restarts on a `--model_dir` in the command must lie
under it (or be a remote URL such as `gs://...`).

Restarts (`restartPolicy` of the worker replicas):

- `ExitCode` (default): the operator re-creates a worker pod only for a
  retryable exit code and fails the job otherwise; the container runs
  COMMAND through `tfdp-launch tfjob-worker`, which forwards SIGTERM to it
  and maps tfdp's codes onto the operator's (see `tfdp.launch.tfjob_worker`):
  a configuration error (2) and other errors (1) are permanent; a preemption
  save (42), a lost peer (43: another worker was killed, so this one's
  collectives failed; both reported as 138) and SIGTERM/SIGKILL (143/137)
  are retried, so when one worker pod is killed every worker is re-created
  and the job resumes. Those re-creations are not counted against
  `backoffLimit` (the operator's rule).
- `OnFailure`: every non-zero exit restarts the container in place, up to
  `runPolicy.backoffLimit` restarts over the whole job, configuration errors
  included.
- `Never`: no restart.

TensorFlow's gRPC endpoints (port 2222 of every worker pod) have no
authentication: restrict who can reach them (a NetworkPolicy) on a shared
cluster.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Any, Sequence

import yaml

from tfdp.launch import _checks
from tfdp.launch import tfjob_worker

#: The port the training operator gives every TensorFlow replica.
TFJOB_PORT = 2222
#: Restart policies a tfdp TFJob may use (`Always` would restart finished workers).
RESTART_POLICIES = ("ExitCode", "OnFailure", "Never")
#: `runPolicy.cleanPodPolicy` values: which pods are deleted when the job ends.
CLEAN_POD_POLICIES = ("Running", "All", "None")
#: Where `--pvc` is mounted unless `--mount_path` says otherwise.
DEFAULT_MOUNT_PATH = "/workspace"
#: `runPolicy.backoffLimit` unless given: as a Kubernetes Job's default.
DEFAULT_BACKOFF_LIMIT = 6
#: The volume name of `--pvc` in the pod.
VOLUME_NAME = "tfdp-storage"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Kubernetes resource quantities, e.g. "4", "500m", "1.5", "16Gi", "512Mi".
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")




@dataclasses.dataclass(frozen=True, kw_only=True)
class TFJobSpec:
    """A validated TFJob description: what `manifest` writes.

    Attributes:
        image: container image every worker runs.
        workers: number of worker replicas.
        command: program and arguments of the container.
        name: the TFJob's name (an RFC 1123 DNS label).
        namespace: its namespace, or None for kubectl's current one.
        gpus_per_worker: `nvidia.com/gpu` limit per worker (0: none).
        cpu: CPU request and limit per worker (a Kubernetes quantity), or None.
        memory: memory request and limit per worker, or None.
        restart_policy: the worker replicas' restart policy, one of
            `RESTART_POLICIES`.
        pvc: the PersistentVolumeClaim mounted in every worker, or None.
        mount_path: where `pvc` is mounted.
        model_dir: the `--model_dir` the command gives, or None.
        backoff_limit: `runPolicy.backoffLimit`.
        clean_pod_policy: `runPolicy.cleanPodPolicy`.
        ttl_seconds_after_finished: `runPolicy.ttlSecondsAfterFinished`, or
            None to keep the finished job until it is deleted.
        gang: whether all workers are scheduled together
            (`runPolicy.schedulingPolicy`).
        queue: the gang scheduler's queue, or None.
        grace_period: the pods' `terminationGracePeriodSeconds`, or None for
            Kubernetes' 30 s.
        warnings: what the launcher warns about (not errors).
    """

    image: str
    workers: int
    command: tuple[str, ...]
    name: str = "tfdp"
    namespace: str | None = None
    gpus_per_worker: int = 0
    cpu: str | None = None
    memory: str | None = None
    restart_policy: str = "ExitCode"
    pvc: str | None = None
    mount_path: str = DEFAULT_MOUNT_PATH
    model_dir: str | None = None
    backoff_limit: int = DEFAULT_BACKOFF_LIMIT
    clean_pod_policy: str = "Running"
    ttl_seconds_after_finished: int | None = None
    gang: bool = False
    queue: str | None = None
    grace_period: int | None = None
    warnings: tuple[str, ...] = ()


#: The container command in front of COMMAND under `restartPolicy: ExitCode`.
WORKER_ENTRY = ("tfdp-launch", "tfjob-worker", "--")


def _check_dns_label(name: str, value: Any, *, max_length: int = 63) -> None:
    if not isinstance(value, str) or len(value) > max_length or not _DNS_LABEL.match(value):
        raise ValueError(
            f"`{name}` must be an RFC 1123 DNS label: at most {max_length} lowercase "
            "letters, digits and '-', starting and ending with a letter or digit, e.g. "
            f"'mnist-run-1'. Received: {name}={_checks.echo(value)}"
        )


def model_dir_of(command: Sequence[str]) -> str | None:
    """The `--model_dir` (or `-model_dir`, `--model_dir=...`) value `command` gives, or None.

    Read as absl reads flags: the last one wins, and nothing after a bare
    `--` is a flag.
    """
    value = None
    args = list(command[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            break
        name, eq, rest = arg.partition("=")
        if name in ("--model_dir", "-model_dir"):
            if eq:
                value = rest
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def _check_mount_path(mount_path: Any) -> str:
    if (not isinstance(mount_path, str) or not mount_path.startswith("/") or ":" in mount_path
            or posixpath.normpath(mount_path) in ("/", "//")
            or ".." in mount_path.split("/")):
        raise ValueError(
            "`mount_path` must be an absolute directory path other than '/', without ':' "
            f"or '..', e.g. '{DEFAULT_MOUNT_PATH}'. Received: mount_path={_checks.echo(mount_path)}")
    return posixpath.normpath(mount_path)


def _check_model_dir(model_dir: str | None, *, pvc: str | None, mount_path: str,
                     restart_policy: str) -> tuple[str, ...]:
    """Refuses a `--model_dir` a restarted pod would not find; returns warnings."""
    restarts = restart_policy != "Never"
    if not restarts:
        return ()
    if model_dir is None:
        if pvc is None:
            return (f"no --pvc: with --restart_policy {restart_policy} a restarted worker "
                    "starts with a new container filesystem, so it can resume only from a "
                    "--model_dir on shared storage. Mount one with --pvc NAME and give the "
                    f"program --model_dir under {mount_path}.",)
        return ()
    if _URL.match(model_dir):
        return ()  # remote storage (gs://, s3://, hdfs://): every pod reaches it
    example = posixpath.join(mount_path, "runs", "my-run")
    if pvc is None:
        raise ValueError(
            f"--model_dir {model_dir} is in the container's own filesystem, which a "
            f"restarted pod does not keep, so --restart_policy {restart_policy} could not "
            "resume from it. Mount a PersistentVolumeClaim with --pvc NAME and put "
            f"--model_dir under --mount_path ({mount_path}), e.g. --model_dir {example}; "
            "or give --restart_policy Never.")
    normal = posixpath.normpath(model_dir)
    if not model_dir.startswith("/") or posixpath.commonpath([normal, mount_path]) != mount_path:
        raise ValueError(
            f"--model_dir {model_dir} is outside the volume mounted at {mount_path} "
            f"(--pvc {pvc}), so a restarted pod could not resume from it. Give an absolute "
            f"--model_dir under {mount_path}, e.g. --model_dir {example}, or mount the "
            "volume where the model_dir is with --mount_path.")
    return ()


def plan_tfjob(
    command: Sequence[str],
    *,
    image: str,
    workers: int,
    name: str = "tfdp",
    namespace: str | None = None,
    gpus_per_worker: int = 0,
    cpu: str | None = None,
    memory: str | None = None,
    restart_policy: str = "ExitCode",
    pvc: str | None = None,
    mount_path: str = DEFAULT_MOUNT_PATH,
    backoff_limit: int = DEFAULT_BACKOFF_LIMIT,
    clean_pod_policy: str = "Running",
    ttl_seconds_after_finished: int | None = None,
    gang: bool = False,
    queue: str | None = None,
    grace_period: int | None = None,
) -> TFJobSpec:
    """Validates a TFJob description.

    Args:
        command: program and arguments of every worker's container, e.g.
            `["tfdp-train", "--model", "mlp"]`.
        image: the container image (must contain tfdp and the program).
        workers: number of workers (>= 1).
        name: the TFJob's name: an RFC 1123 DNS label short enough that the
            operator's pod and service names `NAME-worker-I` are labels too.
            Defaults to `"tfdp"`.
        namespace: a DNS label, or None. Defaults to None.
        gpus_per_worker: GPUs per worker (>= 0). Defaults to 0.
        cpu: CPUs per worker as a Kubernetes quantity (`"4"`, `"500m"`), or
            None. Defaults to None.
        memory: memory per worker as a quantity (`"16Gi"`), or None.
            Defaults to None.
        restart_policy: `"ExitCode"` (retry preemptions and kills, fail on
            configuration errors; see the module docstring), `"OnFailure"`
            or `"Never"`. Defaults to `"ExitCode"`.
        pvc: name of a PersistentVolumeClaim to mount in every worker (it
            must exist in the namespace, with an access mode every worker's
            node can mount: ReadWriteMany for workers on several nodes), or
            None. Defaults to None.
        mount_path: where `pvc` is mounted. Defaults to `/workspace`.
        backoff_limit: `runPolicy.backoffLimit`, >= 0: restarts (OnFailure)
            over the whole job before it fails. Defaults to 6.
        clean_pod_policy: `"Running"` (pods still running when the job ends
            are deleted; finished ones stay for `kubectl logs`), `"All"` or
            `"None"`. Defaults to `"Running"`.
        ttl_seconds_after_finished: delete the finished job (and its pods)
            this many seconds after it ends, or None to keep it. Defaults
            to None.
        gang: schedule all workers at once or none
            (`schedulingPolicy.minAvailable` = workers; needs an operator
            started with a gang scheduler such as Volcano). Defaults to False.
        queue: the gang scheduler's queue (needs `gang`), or None.
        grace_period: seconds between a pod's SIGTERM and SIGKILL
            (`terminationGracePeriodSeconds`): time for the preemption save.
            Defaults to None (Kubernetes' 30 s).

    Returns:
        A `TFJobSpec`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: naming the argument, when a value breaks its rule; and
            when restarts are on and the command's `--model_dir` is not on
            the mounted volume (a restarted pod could not resume).
    """
    command = _checks.check_command(
        command, example="tfdp-launch k8s --image IMAGE --workers 2 -- tfdp-train")
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        raise ValueError(
            "`image` must be a container image reference without spaces, e.g. "
            f"'registry.example.com/tfdp:0.1'. Received: image={_checks.echo(image)}"
        )
    _checks.check_int("workers", workers, minimum=1)
    # The operator names pods and services NAME-worker-INDEX: keep those labels too.
    suffix = len(f"-worker-{workers - 1}")
    _check_dns_label("name", name, max_length=63 - suffix)
    if namespace is not None:
        _check_dns_label("namespace", namespace)
    _checks.check_int("gpus_per_worker", gpus_per_worker, minimum=0)
    for key, value, example in (("cpu", cpu, "'4' or '500m'"), ("memory", memory, "'16Gi'")):
        if value is not None and (not isinstance(value, str) or not _QUANTITY.match(value)):
            raise ValueError(
                f"`{key}` must be a Kubernetes quantity such as {example}. "
                f"Received: {key}={_checks.echo(value)}"
            )
    _checks.check_choice("restart_policy", restart_policy, RESTART_POLICIES)
    _checks.check_choice("clean_pod_policy", clean_pod_policy, CLEAN_POD_POLICIES)
    if pvc is not None and (not isinstance(pvc, str) or len(pvc) > 253
                            or not _DNS_SUBDOMAIN.match(pvc)):
        raise ValueError(
            "`pvc` must name a PersistentVolumeClaim: lowercase letters, digits, '-' and "
            f"'.', e.g. 'tfdp-runs'. Received: pvc={_checks.echo(pvc)}")
    mount_path = _check_mount_path(mount_path)
    _checks.check_int("backoff_limit", backoff_limit, minimum=0)
    _checks.check_int("ttl_seconds_after_finished", ttl_seconds_after_finished, minimum=0,
                      allow_none=True)
    _checks.check_int("grace_period", grace_period, minimum=0, allow_none=True)
    if not isinstance(gang, bool):
        raise TypeError(f"`gang` must be a bool. Received: gang={_checks.echo(gang)}")
    if queue is not None:
        if not gang:
            raise ValueError(f"`queue` is the gang scheduler's queue: give it with gang=True "
                             f"(--gang). Received: queue={_checks.echo(queue)}")
        if not isinstance(queue, str) or not queue or any(c.isspace() for c in queue):
            raise ValueError(f"`queue` must be a queue name without spaces. "
                             f"Received: queue={_checks.echo(queue)}")
    model_dir = model_dir_of(command)
    warnings = _check_model_dir(model_dir, pvc=pvc, mount_path=mount_path,
                                restart_policy=restart_policy)
    return TFJobSpec(image=image, workers=workers, command=tuple(command), name=name,
                     namespace=namespace, gpus_per_worker=gpus_per_worker, cpu=cpu,
                     memory=memory, restart_policy=restart_policy, pvc=pvc,
                     mount_path=mount_path, model_dir=model_dir, backoff_limit=backoff_limit,
                     clean_pod_policy=clean_pod_policy,
                     ttl_seconds_after_finished=ttl_seconds_after_finished, gang=gang,
                     queue=queue, grace_period=grace_period, warnings=warnings)


def manifest(spec: TFJobSpec) -> dict[str, Any]:
    """Returns the TFJob manifest for `spec` as a plain dictionary."""
    if spec.restart_policy == "ExitCode":
        # tfjob-worker forwards SIGTERM and maps tfdp's exit codes to the operator's.
        command, args = list(WORKER_ENTRY), list(spec.command)
    else:
        command, args = [spec.command[0]], list(spec.command[1:])
    container: dict[str, Any] = {
        "name": "tensorflow",  # the container name the training operator requires
        "image": spec.image,
        "command": command,
        "args": args,
        "ports": [{"name": "tfjob-port", "containerPort": TFJOB_PORT}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
    }
    requests = {k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v is not None}
    limits = dict(requests)
    if spec.gpus_per_worker:
        limits["nvidia.com/gpu"] = str(spec.gpus_per_worker)  # quantities are strings
    if limits:
        container["resources"] = {"limits": limits}
        if requests:
            container["resources"]["requests"] = requests
    pod: dict[str, Any] = {"containers": [container]}
    if spec.pvc is not None:
        container["volumeMounts"] = [{"name": VOLUME_NAME, "mountPath": spec.mount_path}]
        pod["volumes"] = [{"name": VOLUME_NAME,
                           "persistentVolumeClaim": {"claimName": spec.pvc}}]
    if spec.grace_period is not None:
        pod["terminationGracePeriodSeconds"] = spec.grace_period
    run_policy: dict[str, Any] = {"cleanPodPolicy": spec.clean_pod_policy,
                                  "backoffLimit": spec.backoff_limit}
    if spec.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    if spec.gang:
        run_policy["schedulingPolicy"] = {"minAvailable": spec.workers}
        if spec.queue is not None:
            run_policy["schedulingPolicy"]["queue"] = spec.queue
    metadata: dict[str, Any] = {"name": spec.name}
    if spec.namespace is not None:
        metadata["namespace"] = spec.namespace
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": metadata,
        "spec": {
            "runPolicy": run_policy,
            "tfReplicaSpecs": {
                "Worker": {
                    "replicas": spec.workers,
                    "restartPolicy": spec.restart_policy,
                    "template": {"spec": pod},
                },
            },
        },
    }


def to_yaml(spec: TFJobSpec) -> str:
    """Returns the TFJob manifest for `spec` as YAML, with a comment header."""
    header = (f"# Written by `tfdp-launch k8s`: {spec.workers} tfdp worker(s); the "
              "training operator sets each pod's TF_CONFIG.\n")
    if spec.restart_policy == "ExitCode":
        header += ("# restartPolicy ExitCode: exit 2 (configuration error) fails the job; a "
                   f"preemption save ({tfjob_worker.PREEMPTION_EXIT_CODE}) or a lost peer "
                   f"({tfjob_worker.PEER_LOST_EXIT_CODE}), both reported as "
                   f"{tfjob_worker.OPERATOR_USER_RETRYABLE},\n# SIGTERM (143) or SIGKILL (137) "
                   "re-creates the pod; any other code fails the job.\n")
    if spec.pvc is not None:
        header += (f"# PersistentVolumeClaim {spec.pvc} is mounted at {spec.mount_path} in "
                   "every worker; it must exist in the job's namespace.\n")
    header += "# Apply with: kubectl apply -f FILE\n"
    return header + yaml.safe_dump(manifest(spec), sort_keys=False, default_flow_style=False)
