"""Tests for `tfdp.launch.gpus` and the launcher's GPU assignment (`--gpus_per_proc`).

No GPU is needed: a stand-in `nvidia-smi` on the workers' PATH prints what the
real `nvidia-smi -L` prints, and each worker prints the `CUDA_VISIBLE_DEVICES`
it received.
"""

import io
import os
import stat
import subprocess
import sys

import pytest

from tfdp.launch import __main__ as launch_main
from tfdp.launch import gpus, local
from multiworker import write_worker_script

# What each worker prints: the GPU variables the launcher gave it.
_PRINT_GPUS = """
import os
print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
print("CUDA_DEVICE_ORDER=" + os.environ.get("CUDA_DEVICE_ORDER", "<unset>"))
"""


def _fake_nvidia_smi(bin_dir, *, count=0, exit_code=0, text=None):
    """Writes `bin_dir/nvidia-smi`, printing `count` GPU lines as `nvidia-smi -L` does."""
    bin_dir.mkdir(exist_ok=True)
    if text is None:
        text = "".join(
            f"GPU {i}: NVIDIA A100-SXM4-40GB (UUID: GPU-{i:08x}-1111-2222-3333-444455556666)\n"
            for i in range(count))
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-L" ] || { echo "stand-in nvidia-smi: only -L" >&2; exit 3; }\n'
        f"cat <<'EOF'\n{text}EOF\n"
        f"exit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def _environ(bin_dir, **extra):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    environ.update(extra)
    return environ


def _run_workers(tmp_path, environ, *, nproc, **kwargs):
    """Runs `_PRINT_GPUS` on `nproc` workers; returns (code, {rank: lines}, stderr)."""
    script = write_worker_script(tmp_path, _PRINT_GPUS)
    out, err = io.BytesIO(), io.BytesIO()
    code = local.run_local([sys.executable, str(script)], nproc_per_node=nproc,
                           environ=environ, stdout=out, stderr=err, grace_period=1.0,
                           **kwargs)
    by_rank = {}
    for line in out.getvalue().decode().splitlines():
        rank, _, text = line.partition("] ")
        by_rank.setdefault(int(rank.lstrip("[")), []).append(text)
    return code, by_rank, err.getvalue().decode()


# -- reading CUDA_VISIBLE_DEVICES and nvidia-smi --------------------------------

@pytest.mark.parametrize("value,devices", [
    ("3,5,6,7", ("3", "5", "6", "7")),
    (" 1, 0 ", ("1", "0")),
    ("", ()),
    ("-1", ()),
    ("0,-1,1", ("0",)),  # CUDA stops at the first entry that is not a device
    ("GPU-8f2a1c3e-aaaa,GPU-11b2", ("GPU-8f2a1c3e-aaaa", "GPU-11b2")),
    ("MIG-GPU-8f2a1c3e/1/0", ("MIG-GPU-8f2a1c3e/1/0",)),
])
def test_parse_visible_devices_follows_cuda(value, devices):
    assert gpus.parse_visible_devices(value) == devices


def test_node_gpus_come_from_nvidia_smi_when_cuda_visible_devices_is_unset(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=4)
    node = gpus.node_gpus(_environ(bin_dir))
    assert node == gpus.NodeGpus(("0", "1", "2", "3"), "nvidia-smi")
    # A preset CUDA_VISIBLE_DEVICES wins over what the machine reports.
    node = gpus.node_gpus(_environ(bin_dir, CUDA_VISIBLE_DEVICES="6,7"))
    assert node == gpus.NodeGpus(("6", "7"), "CUDA_VISIBLE_DEVICES")


def test_mig_lines_of_nvidia_smi_are_not_counted_as_gpus(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", text=(
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)\n"
        "  MIG 3g.20gb     Device  0: (UUID: MIG-bbbb)\n"
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-cccc)\n"))
    assert gpus.node_gpus(_environ(bin_dir)).devices == ("0", "1")


def test_no_gpu_when_nvidia_smi_is_absent_or_finds_no_device(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gpus.node_gpus({"PATH": str(empty)}) == gpus.NodeGpus((), "none")
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", exit_code=6, text="No devices were found\n")
    assert gpus.node_gpus(_environ(bin_dir)) == gpus.NodeGpus((), "none")


def test_a_failing_nvidia_smi_is_said(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", exit_code=9, text=(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"))
    node = gpus.node_gpus(_environ(bin_dir))
    assert node.devices == ()
    assert "failed with exit code 9: NVIDIA-SMI has failed" in node.warning
    assert "Set CUDA_VISIBLE_DEVICES" in node.warning


# -- splitting -------------------------------------------------------------------

def test_split_gives_each_worker_a_contiguous_share():
    node = gpus.NodeGpus(("3", "5", "6", "7"), "CUDA_VISIBLE_DEVICES")
    assert gpus.split_gpus(node, nproc_per_node=2).per_worker == (("3", "5"), ("6", "7"))
    assert gpus.split_gpus(node, nproc_per_node=4).per_worker == (
        ("3",), ("5",), ("6",), ("7",))
    assert gpus.split_gpus(node, nproc_per_node=1).per_worker == (("3", "5", "6", "7"),)
    assert gpus.split_gpus(node, nproc_per_node=3, gpus_per_proc=1).per_worker == (
        ("3",), ("5",), ("6",))
    hidden = gpus.split_gpus(node, nproc_per_node=2, gpus_per_proc=0)
    assert hidden.per_worker == ((), ())
    assert hidden.environment(0, {}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert gpus.split_gpus(gpus.NodeGpus((), "none"), nproc_per_node=2) is None
    assert gpus.split_gpus(gpus.NodeGpus((), "none"), nproc_per_node=2,
                           gpus_per_proc=0) is None


def test_split_refuses_what_cannot_be_shared():
    node = gpus.NodeGpus(("0", "1", "2", "3"), "nvidia-smi")
    with pytest.raises(ValueError, match=r"4 GPU\(s\) \(nvidia-smi -L\) cannot be split "
                                         r"evenly among --nproc_per_node 3 workers"):
        gpus.split_gpus(node, nproc_per_node=3)
    with pytest.raises(ValueError, match=r"--gpus_per_proc 3 with --nproc_per_node 2 needs 6 "
                                         r"GPUs, but this node has 4 GPU"):
        gpus.split_gpus(node, nproc_per_node=2, gpus_per_proc=3)
    with pytest.raises(ValueError, match="this node has no GPU"):
        gpus.split_gpus(gpus.NodeGpus((), "none"), nproc_per_node=1, gpus_per_proc=1)
    with pytest.raises(ValueError, match="`gpus_per_proc` must be an integer >= 0"):
        gpus.split_gpus(node, nproc_per_node=2, gpus_per_proc=-1)


# -- the launcher: what each worker receives ---------------------------------------

def test_workers_split_a_preset_cuda_visible_devices(tmp_path):
    # The stand-in reports 8 GPUs; the launcher's own CUDA_VISIBLE_DEVICES wins.
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=8)
    code, out, err = _run_workers(
        tmp_path, _environ(bin_dir, CUDA_VISIBLE_DEVICES="3,5,6,7"), nproc=2)
    assert code == 0, err
    assert out[0] == ["CUDA_VISIBLE_DEVICES=3,5", "CUDA_DEVICE_ORDER=<unset>"]
    assert out[1] == ["CUDA_VISIBLE_DEVICES=6,7", "CUDA_DEVICE_ORDER=<unset>"]
    assert ("[launch] GPUs per worker (CUDA_VISIBLE_DEVICES; of "
            "CUDA_VISIBLE_DEVICES=3,5,6,7): [0] 3,5 [1] 6,7\n") in err


def test_workers_split_the_gpus_nvidia_smi_lists(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=4)
    code, out, err = _run_workers(tmp_path, _environ(bin_dir), nproc=4)
    assert code == 0, err
    for rank in range(4):
        # nvidia-smi's indices are in PCI bus order: the workers number GPUs the same way.
        assert out[rank] == [f"CUDA_VISIBLE_DEVICES={rank}", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    assert "of 4 GPU(s) listed by nvidia-smi -L): [0] 0 [1] 1 [2] 2 [3] 3\n" in err


def test_workers_split_uuids_and_keep_a_set_device_order(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=2)
    code, out, err = _run_workers(
        tmp_path, _environ(bin_dir, CUDA_VISIBLE_DEVICES="GPU-aa11,GPU-bb22",
                           CUDA_DEVICE_ORDER="FASTEST_FIRST"), nproc=2)
    assert code == 0, err
    assert out[0] == ["CUDA_VISIBLE_DEVICES=GPU-aa11", "CUDA_DEVICE_ORDER=FASTEST_FIRST"]
    assert out[1] == ["CUDA_VISIBLE_DEVICES=GPU-bb22", "CUDA_DEVICE_ORDER=FASTEST_FIRST"]


def test_gpus_per_proc_leaves_the_rest_unused(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=8)
    code, out, err = _run_workers(tmp_path, _environ(bin_dir), nproc=2, gpus_per_proc=3)
    assert code == 0, err
    assert out[0][0] == "CUDA_VISIBLE_DEVICES=0,1,2"
    assert out[1][0] == "CUDA_VISIBLE_DEVICES=3,4,5"
    assert "[0] 0,1,2 [1] 3,4,5; unused: 6,7\n" in err


def test_without_gpus_nothing_is_set_and_nothing_is_logged(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = _run_workers(tmp_path, _environ(empty), nproc=2)
    assert code == 0, err
    assert out[0] == out[1] == ["CUDA_VISIBLE_DEVICES=<unset>", "CUDA_DEVICE_ORDER=<unset>"]
    assert "GPU" not in err


def test_the_launcher_finds_gpus_without_importing_tensorflow(tmp_path):
    # TensorFlow in the launcher would initialise every GPU (and take its memory).
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=2)
    program = ("import sys\n"
               "from tfdp.launch import __main__, local\n"
               "plan = local.plan_local([sys.executable], nproc_per_node=2)\n"
               "print(*[w.env['CUDA_VISIBLE_DEVICES'] for w in plan.workers],\n"
               "      'tensorflow' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program], env=_environ(bin_dir),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0 1 False\n"


def test_a_restart_keeps_each_workers_gpus(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=2)
    plan = local.plan_local([sys.executable], nproc_per_node=2, environ=_environ(bin_dir),
                            max_restarts=1)
    again = local.restart_plan(plan, restart_count=1)
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in again.workers] == ["0", "1"]
    assert [w.env["TFDP_RESTART_COUNT"] for w in again.workers] == ["1", "1"]


def test_each_node_of_a_multi_node_launch_splits_its_own_gpus(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", count=2)
    plan = local.plan_nodes([sys.executable], nnodes=2, node_rank=1,
                            hosts="127.0.0.1:23450,127.0.0.1:23460", nproc_per_node=2,
                            environ=_environ(bin_dir))
    assert [(w.rank, w.env["CUDA_VISIBLE_DEVICES"]) for w in plan.workers] == [
        (2, "0"), (3, "1")]


# -- the command line: refusals exit 2 before anything starts ------------------------

@pytest.mark.parametrize("visible,argv,fragment", [
    ("0,1,2,3", ["--nproc_per_node", "3"],
     "4 GPU(s) (CUDA_VISIBLE_DEVICES=0,1,2,3) cannot be split evenly among --nproc_per_node "
     "3 workers. Use an --nproc_per_node that divides 4, give each worker K GPUs with "
     "--gpus_per_proc K"),
    ("0,1", ["--nproc_per_node", "2", "--gpus_per_proc", "2"],
     "--gpus_per_proc 2 with --nproc_per_node 2 needs 4 GPUs, but this node has 2 GPU(s)"),
    ("", ["--nproc_per_node", "1", "--gpus_per_proc", "1"], "but this node has no GPU"),
    ("0,1", ["--nproc_per_node", "2", "--gpus_per_proc", "-1"],
     "`gpus_per_proc` must be an integer >= 0"),
])
def test_cli_refuses_gpus_that_cannot_be_shared(tmp_path, monkeypatch, capsys, visible, argv,
                                                fragment):
    marker = tmp_path / "started"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SystemExit) as info:
        launch_main.main([*argv, "--", sys.executable, "-c",
                          f"open({str(marker)!r}, 'w').close()"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err
    assert not marker.exists()  # no worker was started
    assert not marker.exists()
