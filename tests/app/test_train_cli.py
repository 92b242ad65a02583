"""The tfdp-train command line: flag errors exit 2 with one line, before training."""

import subprocess
import sys

import pytest

from tfdp.app import train as train_cli


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--global_batch=64", "--per_replica_batch=32"], "Pass at most one of --global_batch"),
        (["--accum_steps=0"], "--accum_steps must be an integer >= 1"),
        (["--model=alexnet"], "--model must be one of"),
        (["--dataset=not_a_dataset_at_all"], "--dataset:"),
        (["--cpu_replicas=2", "--global_batch=63"], "--global_batch: "),
        (["--checkpoint_every=5"], "--checkpoint_every needs --model_dir"),
        (["--warmup_epochs=1", "--warmup_steps=3"], "at most one of --warmup_epochs"),
        (["--collective_timeout=0"], "--collective_timeout must be a positive number"),
        (["--train_files=x.tfrecord"], "--train_files only apply to --dataset=tfrecord"),
        (["--dataset=tfrecord"], "--dataset=tfrecord needs --train_files"),
        (["--dataset=tfrecord", "--train_files=x"], "with --eval needs --eval_files"),
        (["--dataset=tfrecord", "--train_files=/nonexistent/train-*", "--noeval"],
         "--train_files: train files: '/nonexistent/train-*' matches no file"),
        (["--dataset=tfrecord", "--train_files=x", "--noeval", "--image_channels=2"],
         "--image_channels must be 1, 3 or 4"),
        (["--model=cnn", "--sync_bn"], "--sync_bn: model 'cnn' has no BatchNormalization"),
        (["--model=transformer", "--sync_bn"], "Models that take --sync_bn: resnet20"),
        (["--model=mlp", "--remat"], "--remat: model 'mlp' has no blocks to recompute"),
        (["--overlap_sync"], "--overlap_sync needs local steps: pass --sync_every=N > 1"),
        (["--bucket_cap_mb=0"], "--bucket_cap_mb must be a positive number of MiB"),
        # What tfdp.training.option_rules refuses with balanced batches, by flag.
        (["--balance_batches", "--accum_steps=2"],
         "--balance_batches cannot be combined with --accum_steps=2: a worker's share"),
        (["--balance_batches", "--sync_every=8"],
         "--balance_batches cannot be combined with --sync_every=8: local steps"),
        (["--balance_batches", "--outer_lr=0.7"],
         "--balance_batches cannot be combined with --sync_every=1 --outer_lr=0.7"),
        (["--balance_batches", "--gradient_compression=powersgd"],
         "--balance_batches cannot be combined with --gradient_compression=powersgd"),
        (["--balance_batches", "--all_reduce_dtype=bfloat16"],
         "--balance_batches cannot be combined with --all_reduce_dtype=bfloat16"),
        (["--balance_batches", "--shard_optimizer_state"],
         "--balance_batches cannot be combined with --shard_optimizer_state: ZeRO-1"),
        (["--balance_batches", "--jit_compile"],
         "--balance_batches cannot be combined with --jit_compile: each worker times"),
        (["--balance_batches", "--loss_normalization=per_replica"],
         "--balance_batches cannot be combined with --loss_normalization=per_replica"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(parse_flags, capsys, argv, message):
    parse_flags(*argv)
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["tfdp-train"])
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1, err_lines
    assert err_lines[0].startswith("tfdp-train: error: ") and message in err_lines[0]


@pytest.mark.parametrize("flags, expected", [
    ((), "None"),
    (("--gradient_compression=bfloat16",), "'bfloat16'"),
    (("--gradient_compression=powersgd", "--compression_rank=2"),
     "PowerSGD(rank=2, start_step=0, min_compression_ratio=2.0)"),
    (("--gradient_compression=topk", "--topk_fraction=0.05"), "TopK(fraction=0.05)"),
    (("--gradient_compression=float8",), "'float8'"),
])
def test_gradient_compression_flags_build_the_compressor(parse_flags, flags, expected):
    parse_flags(*flags)
    assert repr(train_cli.config_from_flags().gradient_compression_argument()) == expected


@pytest.mark.parametrize("flags, expected", [
    ((), None),
    (("--sync_every=8",), None),
    (("--sync_every=16", "--outer_lr=0.7"), (0.7, 0.9)),
    (("--outer_lr=0.5", "--outer_momentum=0.8"), (0.5, 0.8)),
])
def test_local_step_flags_build_the_outer_optimizer(parse_flags, flags, expected):
    parse_flags(*flags)
    config = train_cli.config_from_flags()
    outer = config.outer_optimizer_argument()
    if expected is None:
        assert outer is None
    else:
        assert outer.nesterov
        assert (float(outer.learning_rate), outer.momentum) == pytest.approx(expected)


def _loop_arguments(parse_flags, monkeypatch, *flags) -> dict:
    """The keyword arguments `tfdp-train *flags` hands tfdp.compile / tfdp.Trainer (stopped there)."""
    from tfdp.app import experiment

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        raise Stop(kwargs)

    monkeypatch.setattr(experiment.fit_compile, "compile", capture)
    monkeypatch.setattr(experiment, "Trainer", capture)
    parse_flags(*flags)
    with pytest.raises(Stop) as stopped:
        train_cli.main(["tfdp-train"])
    return stopped.value.args[0]


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_overlap_sync_reaches_the_training_loop_with_calls_that_end_each_window(
        parse_flags, monkeypatch, loop):
    """--overlap_sync is handed to tfdp.compile / tfdp.Trainer, with steps per call dividing
    --sync_every (the loops refuse the others); stopped there, nothing trains."""
    kwargs = _loop_arguments(
        parse_flags, monkeypatch, "--model=mlp", "--cpu_replicas=2", "--epochs=1",
        "--sync_every=8", "--outer_lr=0.7", "--overlap_sync", "--steps_per_loop=10",
        f"--loop={loop}")
    assert kwargs["overlap_sync"] is True and kwargs["sync_every"] == 8
    assert kwargs["steps_per_execution" if loop == "fit" else "steps_per_loop"] == 8


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_bucket_cap_mb_reaches_the_training_loop(parse_flags, monkeypatch, loop):
    """--bucket_cap_mb is handed to tfdp.compile / tfdp.Trainer; stopped there, nothing trains."""
    kwargs = _loop_arguments(parse_flags, monkeypatch, "--model=mlp", "--cpu_replicas=2",
                             "--epochs=1", "--bucket_cap_mb=0.5", f"--loop={loop}")
    assert kwargs["bucket_cap_mb"] == 0.5


@pytest.mark.slow
def test_shard_optimizer_state_reaches_the_trained_optimizer(parse_flags, tmp_path):
    """Two logical replicas, 2 steps: the optimizer that trained kept half of its slots."""
    parse_flags("--model=mlp", "--cpu_replicas=2", "--epochs=1", "--steps_per_epoch=2",
                "--optimizer=adam", "--shard_optimizer_state", f"--model_dir={tmp_path}")
    train_cli.main(["tfdp-train"])
    import json

    import tensorflow as tf

    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    # The final checkpoint's optimizer slots are this replica's chunks: flat,
    # half of each variable (rounded up), where unsharded Adam's are shaped
    # like the kernels.
    saved = dict(tf.train.list_variables(str(tmp_path)))
    slots = [shape for name, shape in saved.items()
             if "inner_optimizer/_variables" in name and shape]
    kernels = [shape for name, shape in saved.items()  # the wrapper's: the model's weights
               if name.startswith("optimizer/_trainable_variables/") and len(shape) == 2]
    assert slots and kernels
    assert all(len(shape) == 1 for shape in slots)
    assert max(s[0] for s in slots) == max(-(-k[0] * k[1] // 2) for k in kernels)
    # Both replicas' chunks are kept beside it, as --loop=custom keeps them.
    assert [p.name for p in (tmp_path / "replica_state" / "ckpt-2").iterdir()] == [
        "worker-0-of-1.npz"]


def test_remat_and_sync_bn_reach_the_model_builder(parse_flags, monkeypatch):
    import keras

    from tfdp.app import experiment
    from tfdp.models import remat

    built = {}

    def train_and_evaluate(config, *, build_dataset, build_model, clock):
        built["model"] = build_model(config.model, input_shape=(8, 8, 3), num_classes=3)
        built["phases"] = list(clock.seconds)  # tfdp-train's clock, started with the process

    monkeypatch.setattr(experiment, "train_and_evaluate", train_and_evaluate)
    parse_flags("--model=resnet20", "--remat", "--sync_bn")
    train_cli.main(["tfdp-train"])
    layers = list(_all_layers(built["model"]))
    assert sum(isinstance(layer, remat.Rematerialized) for layer in layers) == 9
    norms = [layer for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 21 and all(layer.synchronized for layer in norms)
    assert built["phases"] == ["imports", "checks"]


def _all_layers(model):
    for layer in model.layers:
        yield layer
        inner = getattr(layer, "block", layer)
        if hasattr(inner, "layers"):
            yield from _all_layers(inner)


def test_flags_map_onto_run_config(parse_flags):
    parse_flags("--model=mlp", "--per_replica_batch=16", "--accum_steps=2", "--optimizer=lars",
                "--loop=custom", "--warmup_epochs=0.5", "--cpu_replicas=2",
                "--all_reduce_dtype=bfloat16", "--loss_normalization=per_replica")
    config = train_cli.config_from_flags()
    assert config.all_reduce_dtype == "bfloat16"
    assert config.loss_normalization == "per_replica"
    assert (config.model, config.per_replica_batch, config.global_batch) == ("mlp", 16, None)
    assert (config.accum_steps, config.optimizer, config.loop) == (2, "lars", "custom")
    assert (config.warmup_epochs, config.cpu_replicas) == (0.5, 2)


@pytest.mark.slow
def test_console_script_rejects_contradictory_flags():
    result = subprocess.run(
        ["tfdp-train", "--global_batch=64", "--per_replica_batch=8"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "tfdp-train: error: Pass at most one of --global_batch" in result.stderr


@pytest.mark.slow
def test_helpfull_lists_the_flags():
    result = subprocess.run([sys.executable, "-m", "tfdp.app.train", "--helpfull"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1  # absl's --helpfull prints the flags, then exits 1
    for flag in ("--accum_steps", "--global_batch", "--loop", "--lr_scaling", "--flagfile"):
        assert flag in result.stdout


@pytest.mark.parametrize("error, code", [
    ("PortInUseError", 44),  # the launcher reads 44 as a port collision and retries
    ("StartupError", 1),
])
def test_startup_errors_exit_with_their_own_code(parse_flags, capsys, monkeypatch, error, code):
    from tfdp.app import experiment
    from tfdp.distribute import startup

    def fail(*args, **kwargs):
        raise getattr(startup, error)("This worker cannot listen on port 1234.")

    monkeypatch.setattr(experiment, "train_and_evaluate", fail)
    parse_flags("--dataset=digits")
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["tfdp-train"])
    assert exit_info.value.code == code
    assert "tfdp-train: error: This worker cannot listen on port 1234." in capsys.readouterr().err
