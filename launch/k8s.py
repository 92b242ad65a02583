"""Kubernetes manifests for tfdp jobs: `tfdp-launch k8s ...`.

This module owns one translation: a job description (image, worker count,
resources) and the command every worker runs, into a Kubeflow `TFJob`
manifest (`kubeflow.org/v1`, served by the Kubeflow Training Operator). The
operator creates one pod and one service per worker and sets each pod's
TF_CONFIG (`{"cluster": {"worker": [...]}, "task": {"type": "worker",
"index": i}}`, port 2222), which `tfdp.make_strategy()` reads: worker 0 is the
chief. It does not talk to a cluster; apply the manifest with
`kubectl apply -f`.

Workers restart with `restartPolicy: OnFailure`; a restarted worker resumes
from the latest checkpoint if the program uses `tfdp.Trainer` with a
`model_dir` on storage every pod mounts.

TensorFlow's gRPC endpoints (port 2222 of every worker pod) have no
authentication: restrict who can reach them (a NetworkPolicy) on a shared
cluster.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import yaml

from tfdp.launch import _checks

#: The port the training operator gives every TensorFlow replica.
TFJOB_PORT = 2222
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
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
    """

    image: str
    workers: int
    command: tuple[str, ...]
    name: str = "tfdp"
    namespace: str | None = None
    gpus_per_worker: int = 0
    cpu: str | None = None
    memory: str | None = None


def _check_dns_label(name: str, value: Any, *, max_length: int = 63) -> None:
    if not isinstance(value, str) or len(value) > max_length or not _DNS_LABEL.match(value):
        raise ValueError(
            f"`{name}` must be an RFC 1123 DNS label: at most {max_length} lowercase "
            "letters, digits and '-', starting and ending with a letter or digit, e.g. "
            f"'mnist-run-1'. Received: {name}={_checks.echo(value)}"
        )


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

    Returns:
        A `TFJobSpec`.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: naming the argument, when a value breaks its rule.
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
    return TFJobSpec(image=image, workers=workers, command=tuple(command), name=name,
                     namespace=namespace, gpus_per_worker=gpus_per_worker, cpu=cpu,
                     memory=memory)


def manifest(spec: TFJobSpec) -> dict[str, Any]:
    """Returns the TFJob manifest for `spec` as a plain dictionary."""
    container: dict[str, Any] = {
        "name": "tensorflow",  # the container name the training operator requires
        "image": spec.image,
        "command": [spec.command[0]],
        "args": list(spec.command[1:]),
        "ports": [{"name": "tfjob-port", "containerPort": TFJOB_PORT}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
    }
    requests = {k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v is not None}
    limits = dict(requests)
    if spec.gpus_per_worker:
        limits["nvidia.com/gpu"] = spec.gpus_per_worker
    if limits:
        container["resources"] = {"limits": limits}
        if requests:
            container["resources"]["requests"] = requests
    metadata: dict[str, Any] = {"name": spec.name}
    if spec.namespace is not None:
        metadata["namespace"] = spec.namespace
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": metadata,
        "spec": {
            "tfReplicaSpecs": {
                "Worker": {
                    "replicas": spec.workers,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [container]}},
                },
            },
        },
    }


def to_yaml(spec: TFJobSpec) -> str:
    """Returns the TFJob manifest for `spec` as YAML, with a comment header."""
    header = (f"# Written by `tfdp-launch k8s`: {spec.workers} tfdp worker(s); the "
              "training operator sets each pod's TF_CONFIG.\n"
              "# Apply with: kubectl apply -f FILE\n")
    return header + yaml.safe_dump(manifest(spec), sort_keys=False, default_flow_style=False)
