"""RunConfig: every flag rule, checked before anything starts."""

import pytest

from tfdp.app import experiment, run_config
from tfdp.app.run_config import ConfigError, RunConfig


def test_defaults_are_valid_and_default_the_global_batch():
    assert RunConfig().global_batch == 64
    assert RunConfig(global_batch=128).global_batch == 128
    config = RunConfig(per_replica_batch=16)
    assert (config.global_batch, config.per_replica_batch) == (None, 16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(global_batch=64, per_replica_batch=32), "at most one of --global_batch"),
        (dict(global_batch=64, accum_steps=0), "--accum_steps must be an integer >= 1"),
        (dict(global_batch=0), "--global_batch must be an integer >= 1"),
        (dict(global_batch=64, optimizer="rmsprop"), "--optimizer must be one of sgd, momentum"),
        (dict(global_batch=64, strategy="tpu"), "--strategy must be one of"),
        (dict(global_batch=64, decay="exp"), "--decay must be one of"),
        (dict(global_batch=64, loop="estimator"), "--loop must be one of fit, custom"),
        (dict(global_batch=64, mixed_precision="fp8"), "--mixed_precision must be one of"),
        (dict(all_reduce_dtype="float16"), "--all_reduce_dtype must be one of bfloat16"),
        (dict(loss_normalization="mean"), "--loss_normalization must be one of global, per_replica"),
        (dict(gradient_compression="qsgd"), "--gradient_compression must be one of none, bfloat16"),
        (dict(compression_rank=0), "--compression_rank must be an integer >= 1"),
        (dict(topk_fraction=0.0), r"--topk_fraction must be in \(0, 1\]"),
        (dict(topk_fraction=2.0), r"--topk_fraction must be in \(0, 1\]"),
        (dict(gradient_compression="bfloat16", all_reduce_dtype="float16"),
         "--all_reduce_dtype must be one of"),
        (dict(gradient_compression="float8", all_reduce_dtype="bfloat16"),
         "--gradient_compression=float8 cannot be combined with --all_reduce_dtype=bfloat16"),
        (dict(sync_every=8, gradient_compression="float8"),
         "--gradient_compression=float8 cannot be combined with --sync_every=8"),
        (dict(sync_every=0), "--sync_every must be an integer >= 1"),
        (dict(outer_lr=0.0), "--outer_lr must be a positive number"),
        (dict(outer_momentum=0.9), "--outer_momentum needs --outer_lr"),
        (dict(outer_lr=0.7, outer_momentum=1.0), r"--outer_momentum must be in \[0, 1\)"),
        (dict(sync_every=4, shard_optimizer_state=True),
         "--shard_optimizer_state cannot be combined with --sync_every=4"),
        (dict(sync_every=8, gradient_compression="topk"),
         "--gradient_compression=topk cannot be combined with --sync_every=8"),
        (dict(outer_lr=0.7, all_reduce_dtype="bfloat16"),
         "--all_reduce_dtype=bfloat16 cannot be combined with --sync_every=1 and --outer_lr"),
        (dict(global_batch=64, warmup_epochs=1.0, warmup_steps=10), "at most one of --warmup"),
        (dict(global_batch=64, warmup_epochs=20.0, epochs=10), "--warmup_epochs must be in"),
        (dict(global_batch=64, base_lr=0.0), "--base_lr must be > 0"),
        (dict(global_batch=64, weight_decay=-1.0), "--weight_decay must be >= 0"),
        (dict(global_batch=64, checkpoint_every=10), "--checkpoint_every needs --model_dir"),
        (dict(global_batch=64, steps_per_loop=0), "--steps_per_loop must be an integer >= 1"),
        (dict(global_batch=64, epochs=0), "--epochs must be an integer >= 1"),
        (dict(remat="yes"), "--remat must be true or false"),
    ],
)
def test_invalid_or_contradictory_flags(kwargs, message):
    with pytest.raises(ConfigError, match=message) as error:
        RunConfig(**kwargs)
    assert "Received" in str(error.value)


@pytest.mark.parametrize(
    "kwargs, replicas, expected",
    [
        (dict(global_batch=64), 2, (32, 2, 1)),
        (dict(global_batch=64, accum_steps=4), 2, (8, 2, 4)),
        (dict(per_replica_batch=16, accum_steps=2), 4, (16, 4, 2)),
    ],
)
def test_batch_config_from_flags(kwargs, replicas, expected):
    batch = experiment.batch_config(RunConfig(**kwargs), replicas)
    assert (batch.per_replica, batch.num_replicas, batch.accum_steps) == expected


def test_global_batch_that_does_not_divide_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--global_batch: .*Nearest valid global batches: 60 or 64"):
        experiment.batch_config(RunConfig(global_batch=63, accum_steps=2), 2)


@pytest.mark.parametrize(
    "kwargs, peak, warmup",
    [
        (dict(global_batch=256, base_lr=0.1, base_batch=64), 0.4, 0),
        (dict(global_batch=256, base_lr=0.1, base_batch=64, lr_scaling="sqrt"), 0.2, 0),
        (dict(global_batch=256, base_lr=0.1, base_batch=64, lr_scaling="none"), 0.1, 0),
        (dict(global_batch=256, base_lr=0.1, warmup_epochs=2.0), 0.1, 20),
        (dict(global_batch=256, base_lr=0.1, warmup_steps=7), 0.1, 7),
    ],
)
def test_learning_rate_schedule(kwargs, peak, warmup):
    config = RunConfig(epochs=10, **kwargs)
    batch = experiment.batch_config(config, 2)
    got_peak, schedule = experiment.learning_rate_schedule(config, batch, steps_per_epoch=10)
    assert got_peak == pytest.approx(peak)
    assert schedule.warmup_steps == warmup
    assert float(schedule(max(warmup, 1) - 1)) == pytest.approx(peak)  # peak at the end of warmup


def test_step_decay_boundaries_at_half_and_three_quarters():
    config = RunConfig(global_batch=64, decay="step", base_lr=1.0, epochs=4)
    batch = experiment.batch_config(config, 1)
    _, schedule = experiment.learning_rate_schedule(config, batch, steps_per_epoch=10)
    assert [float(schedule(s)) for s in (19, 20, 29, 30)] == pytest.approx([1.0, 0.1, 0.1, 0.01])


def test_epoch_seeds_differ_and_are_deterministic():
    seeds = [experiment.epoch_seed(3, e) for e in range(5)]
    assert len(set(seeds)) == 5 and seeds == [experiment.epoch_seed(3, e) for e in range(5)]


@pytest.mark.parametrize(
    "steps_per_loop, steps_per_epoch, expected",
    [(10, None, 10), (2, 5, 1), (10, 22, 2), (4, 8, 4), (10, 100, 10), (7, 3, 3)],
)
def test_steps_per_execution_divides_the_epoch(steps_per_loop, steps_per_epoch, expected):
    assert experiment.steps_per_execution_for(steps_per_loop, steps_per_epoch) == expected


@pytest.mark.parametrize(
    "steps_per_loop, steps_per_epoch, checkpoint_every, expected",
    [(10, None, 4, 4), (10, None, 15, 5), (10, 22, 4, 2), (10, 20, 30, 10), (3, None, 7, 1)],
)
def test_steps_per_execution_lets_the_backup_land_on_its_step(
    steps_per_loop, steps_per_epoch, checkpoint_every, expected
):
    assert experiment.steps_per_execution_for(
        steps_per_loop, steps_per_epoch, checkpoint_every) == expected


@pytest.mark.parametrize(
    "steps_per_loop, steps_per_epoch, checkpoint_every, window, expected",
    [(10, None, None, 8, 8), (10, None, None, 16, 8), (10, 22, None, 16, 2),
     (10, None, 12, 8, 4), (10, None, None, None, 10)],
)
def test_steps_per_execution_ends_with_each_overlapped_window(
    steps_per_loop, steps_per_epoch, checkpoint_every, window, expected
):
    assert experiment.steps_per_execution_for(
        steps_per_loop, steps_per_epoch, checkpoint_every, window) == expected


def test_loss_normalizations_are_the_library_s():
    from tfdp.training import loss_normalization

    assert run_config.LOSS_NORMALIZATIONS == loss_normalization.MODES


def test_model_arguments_pass_only_the_options_switched_on():
    assert RunConfig().model_arguments() == {}
    assert RunConfig(model="resnet20", remat=True, sync_bn=True, accum_steps=2
                     ).model_arguments() == {"remat": True, "sync_bn": True}
