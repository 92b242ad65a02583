"""tfdp.experiment.train_and_evaluate, in-process, on the offline digits data."""

import json

import keras
import pytest

from tfdp import experiment
from tfdp import train as train_cli
from tfdp.run_config import ConfigError, RunConfig


def _small_model(name, *, input_shape, num_classes):
    assert name == "tiny"
    return keras.Sequential(
        [keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)]
    )


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("digits_data"))


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_run_writes_a_summary_the_chief_owns(tmp_path, digits_dir, loop):
    config = RunConfig(
        model="tiny", dataset="digits", data_dir=digits_dir, epochs=2, steps_per_epoch=5,
        cpu_replicas=2, global_batch=32, accum_steps=2, loop=loop, steps_per_loop=2,
        model_dir=str(tmp_path / "run"), optimizer="momentum", base_lr=0.05, warmup_steps=2,
    )
    summary = experiment.train_and_evaluate(
        config, build_dataset=train_cli._build_dataset(config), build_model=_small_model
    )
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == 10
    assert on_disk["batch"] == {"per_replica": 8, "replicas": 2, "accum_steps": 2, "global": 32}
    assert on_disk["strategy"]["num_replicas_in_sync"] == 2
    assert set(on_disk["train"]) >= {"loss", "accuracy"}
    assert set(on_disk["eval"]) >= {"loss", "accuracy"}
    assert 0.0 <= on_disk["eval"]["accuracy"] <= 1.0
    assert on_disk["examples_per_second"] > 0 and on_disk["wall_time_seconds"] > 0
    assert on_disk["config"]["loop"] == loop


def test_steps_per_epoch_beyond_the_data_is_refused(digits_dir):
    config = RunConfig(model="tiny", dataset="digits", data_dir=digits_dir, global_batch=64,
                       steps_per_epoch=1000, eval=False)
    with pytest.raises(ConfigError, match="--steps_per_epoch=1000 exceeds the 22 global batches"):
        experiment.train_and_evaluate(config, build_dataset=train_cli._build_dataset(config),
                                      build_model=_small_model)


def test_fit_loop_refuses_a_model_dir_with_a_checkpoint(tmp_path, digits_dir):
    config = RunConfig(model="tiny", dataset="digits", data_dir=digits_dir, global_batch=64,
                       epochs=1, steps_per_epoch=2, eval=False, model_dir=str(tmp_path))
    experiment.train_and_evaluate(config, build_dataset=train_cli._build_dataset(config),
                                  build_model=_small_model)
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        experiment.train_and_evaluate(config, build_dataset=train_cli._build_dataset(config),
                                      build_model=_small_model)
