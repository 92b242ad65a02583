"""The README's main command, end to end: two workers through `launch`, no network.

`tfdp-launch --nproc_per_node 2 -- tfdp-train --dataset=digits --model=cnn
--model_dir=DIR` must reach >= 0.95 test accuracy with either loop, and so must
the large-batch variant (LARS, a 4x larger global batch, linear LR scaling and
warmup). Each run starts two TensorFlow workers and trains for real, so these
are the suite's slowest tests; they still run in CI.
"""

import json
import shutil

import pytest

from multiworker import run_launch
from tfdp.app import phase_clock

#: The accuracy the README promises for the main command.
TARGET_ACCURACY = 0.95
#: Seconds one two-worker run may take before it counts as hung.
RUN_TIMEOUT = 420.0


def _tfdp_train(tmp_path, data_dir, *flags):
    model_dir = tmp_path / "run"
    command = [shutil.which("tfdp-train"), "--dataset=digits", "--model=cnn",
               f"--model_dir={model_dir}", f"--data_dir={data_dir}", *flags]
    result = run_launch(command, nproc=2, timeout=RUN_TIMEOUT, cwd=tmp_path, check=True)
    summary = json.loads((model_dir / "summary.json").read_text())
    return result, summary


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # One prepared copy of digits for every run in this module.
    return tmp_path_factory.mktemp("tfds")


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_main_command_reaches_target_accuracy_on_two_workers(tmp_path, data_dir, loop):
    result, summary = _tfdp_train(tmp_path, data_dir, f"--loop={loop}")
    assert summary["eval"]["accuracy"] >= TARGET_ACCURACY, result.describe()
    assert summary["strategy"]["num_workers"] == 2
    assert summary["batch"] == {"per_replica": 32, "replicas": 2, "accum_steps": 1,
                                "global": 64}
    assert summary["steps"] == summary["config"]["epochs"] * summary["steps_per_epoch"]
    # Where the chief's time went: every phase, none negative, together no
    # more than the wall time since its process started.
    phases = summary["phases"]
    assert list(phases["seconds"]) == list(phase_clock.PHASES)
    assert min(phases["seconds"].values()) >= 0.0
    assert sum(phases["seconds"].values()) <= phases["wall_seconds"]
    # The train pipeline is built twice per run, whatever the epochs: once
    # for its description (shapes, steps), once as the stream every epoch
    # runs on.
    assert phases["counts"]["train_pipeline_builds"] == 2
    assert phases["counts"]["eval_pipeline_builds"] == 1
    assert [row["epoch"] for row in phases["epochs"]] == list(range(summary["config"]["epochs"]))
    # Only the chief prints progress and results; worker 1 stays quiet.
    assert any("tfdp-train: eval" in line for line in result.worker_stdout(0))
    assert result.worker_stdout(0)[-1].startswith("tfdp-train: time by phase: imports ")
    assert not [line for line in result.worker_stdout(1) if line.strip()], result.describe()


@pytest.mark.slow
def test_large_batch_lars_with_linear_scaling_and_warmup(tmp_path, data_dir):
    result, summary = _tfdp_train(
        tmp_path, data_dir, "--optimizer=lars", "--global_batch=256", "--base_batch=64",
        "--base_lr=1.0", "--lr_scaling=linear", "--warmup_epochs=2", "--epochs=30",
        "--loop=custom",
    )
    assert summary["eval"]["accuracy"] >= TARGET_ACCURACY, result.describe()
    assert summary["batch"]["global"] == 256
    assert summary["learning_rate"] == pytest.approx(1.0 * 256 / 64)


#: (flags, loop) of the communication-saving methods that must still reach the target.
COMMUNICATION_RUNS = {
    "powersgd_rank2": (("--gradient_compression=powersgd", "--compression_rank=2"), "fit"),
    "topk_1_percent": (("--gradient_compression=topk", "--topk_fraction=0.01"), "custom"),
    "local_sgd_h8": (("--sync_every=8",), "fit"),
    # 10 epochs of 22 steps are 20 outer steps: the paper's outer momentum 0.9
    # (tuned for thousands) overshoots here (0.947 with the custom loop).
    "diloco_h16": (("--sync_every=16", "--outer_lr=0.7", "--outer_momentum=0.5"), "custom"),
    # E4M3 with a per-tensor scale and error feedback: a quarter of float32's bytes.
    "float8": (("--gradient_compression=float8",), "fit"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMUNICATION_RUNS))
def test_communication_methods_reach_target_accuracy_on_two_workers(tmp_path, data_dir, name):
    """The main command with each way of sending less still reaches the README's accuracy."""
    flags, loop = COMMUNICATION_RUNS[name]
    result, summary = _tfdp_train(tmp_path, data_dir, f"--loop={loop}", *flags)
    assert summary["eval"]["accuracy"] >= TARGET_ACCURACY, result.describe()
    assert summary["strategy"]["num_workers"] == 2
    for flag in flags:
        key, value = flag[2:].split("=")
        assert str(summary["config"][key]) == value


@pytest.mark.slow
def test_balanced_batches_reach_target_accuracy_on_two_workers(tmp_path, data_dir):
    """--balance_batches with fit and a model_dir (its BackupAndRestore input): every worker
    reads whole global batches, the plan always splits 64, and digits still reaches 0.95."""
    result, summary = _tfdp_train(tmp_path, data_dir, "--loop=fit", "--balance_batches")
    assert summary["eval"]["accuracy"] >= TARGET_ACCURACY, result.describe()
    assert summary["strategy"]["num_workers"] == 2 and summary["config"]["balance_batches"]
    assert summary["steps"] == summary["config"]["epochs"] * summary["steps_per_epoch"]
    assert summary["steps_per_epoch"] == 1437 // 64  # the whole split, in global batches
    balanced = summary["balanced_batches"]
    assert sum(balanced["shares"]) == 64
    assert all(sum(shares) == 64 for _, shares in balanced["plans"])
    assert any("balanced batches: every worker reads each global batch of 64 whole" in line
               for line in result.worker_stdout(0))
