"""Tests for `tfdp.launch.k8s` and `tfdp-launch k8s`: the TFJob manifest."""

import pytest
import yaml

from tfdp.launch import __main__ as launch_main
from tfdp.launch import k8s


def _container(manifest):
    return manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def test_cli_prints_a_tfjob_manifest(capsys):
    code = launch_main.main([
        "k8s", "--image", "registry.example.com/tfdp:0.1", "--workers", "4", "--name",
        "mnist-1", "--namespace", "ml", "--gpus_per_worker", "1", "--cpu", "4", "--memory",
        "16Gi", "--", "tfdp-train", "--model", "mlp", "--epochs", "3"])
    assert code == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "mnist-1", "namespace": "ml"}
    assert list(manifest["spec"]["tfReplicaSpecs"]) == ["Worker"]  # worker 0 is the chief
    worker = manifest["spec"]["tfReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    assert worker["restartPolicy"] == "ExitCode"
    container = _container(manifest)
    assert container["name"] == "tensorflow"
    assert container["image"] == "registry.example.com/tfdp:0.1"
    # Under ExitCode the command runs behind the exit-code mapper.
    assert container["command"] == ["tfdp-launch", "tfjob-worker", "--"]
    assert container["args"] == ["tfdp-train", "--model", "mlp", "--epochs", "3"]
    assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
    assert container["resources"] == {
        "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "requests": {"cpu": "4", "memory": "16Gi"}}
    # The operator sets TF_CONFIG; the manifest must not.
    assert all(entry["name"] != "TF_CONFIG" for entry in container.get("env", []))


def test_minimal_manifest_has_no_resources_or_namespace():
    manifest = yaml.safe_load(k8s.to_yaml(k8s.plan_tfjob(["tfdp-train"], image="tfdp",
                                                         workers=1)))
    assert manifest["metadata"] == {"name": "tfdp"}
    assert "resources" not in _container(manifest)
    assert "volumeMounts" not in _container(manifest)
    assert _container(manifest)["args"] == ["tfdp-train"]
    on_failure = k8s.manifest(k8s.plan_tfjob(["tfdp-train"], image="tfdp", workers=1,
                                             restart_policy="OnFailure"))
    assert (_container(on_failure)["command"], _container(on_failure)["args"]) == (
        ["tfdp-train"], [])


def test_output_file(tmp_path, capsys):
    path = tmp_path / "tfjob.yaml"
    code = launch_main.main(["k8s", "--image", "tfdp", "--workers", "2", "--output", str(path),
                             "--", "python", "train.py"])
    assert code == 0
    assert capsys.readouterr().out == ""
    assert yaml.safe_load(path.read_text())["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 2


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--workers", "0"], "`workers` must be a positive integer. Received: workers=0"),
        (["--workers", "2", "--name", "Bad_Name"], "`name` must be an RFC 1123 DNS label"),
        (["--workers", "2", "--name=-x"], "Received: name='-x'"),
        (["--workers", "2", "--name", "a" * 60], "at most 54 lowercase"),
        (["--workers", "2", "--namespace", "ML"], "`namespace` must be an RFC 1123 DNS label"),
        (["--workers", "2", "--gpus_per_worker", "-1"], "`gpus_per_worker` must be an integer >= 0"),
        (["--workers", "2", "--cpu", "four"], "`cpu` must be a Kubernetes quantity"),
        (["--workers", "2", "--memory", "16 GB"], "`memory` must be a Kubernetes quantity"),
        (["--workers", "2", "--image", "my image"], "`image` must be a container image"),
    ],
)
def test_cli_rejects_bad_arguments(argv, fragment, capsys):
    if "--image" not in argv:
        argv = ["--image", "tfdp", *argv]
    with pytest.raises(SystemExit) as info:
        launch_main.main(["k8s", *argv, "--", "tfdp-train"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "usage: tfdp-launch k8s --image IMAGE --workers N" in err


def test_name_leaves_room_for_the_operators_pod_names():
    # NAME-worker-9 must still be a DNS label: 63 - len("-worker-9") = 54.
    assert k8s.plan_tfjob(["x"], image="i", workers=10, name="a" * 54).name == "a" * 54
    with pytest.raises(ValueError, match="at most 53"):
        k8s.plan_tfjob(["x"], image="i", workers=11, name="a" * 54)
