"""Tests for tfdp.distribute.config_check: workers started with different configurations.

Fast tests check the digest and the mismatch message in this process; the
slow ones launch real workers with the same and with different seeds (the
library call, then `tfdp-train`).
"""

import shutil

import pytest

import tfdp
from multiworker import run_launch, run_worker_script
from tfdp.app import run_config
from tfdp.distribute import config_check


# --- the configuration digest ---------------------------------------------------

def test_the_digest_ignores_key_order_and_sees_every_value():
    a = {"model": "mlp", "seed": 0, "lr": 0.1, "layers": [1, 2]}
    assert config_check.config_digest(a) == config_check.config_digest(dict(reversed(a.items())))
    assert config_check.config_digest(a) != config_check.config_digest({**a, "seed": 1})
    assert config_check.config_digest(a) != config_check.config_digest({**a, "lr": 0.1000001})
    assert config_check.config_digest(a, exclude=["seed"]) == config_check.config_digest(
        {**a, "seed": 1}, exclude=["seed"])


def test_a_run_config_is_digested_as_its_fields():
    config = run_config.RunConfig(seed=3)
    assert config_check.config_digest(config) == config_check.config_digest(config.to_dict())


def test_the_digest_refuses_other_objects_and_unknown_exclusions():
    with pytest.raises(TypeError, match="`config` must be a mapping"):
        config_check.config_digest(["seed", 1])
    with pytest.raises(ValueError, match=r"`exclude` must name fields.*\['sede'\]"):
        config_check.config_digest({"seed": 1}, exclude=["sede"])


def test_one_worker_compares_nothing():
    strategy = tfdp.make_strategy(cpu_replicas=2)
    digest = config_check.check_same_config(strategy, {"seed": 1})
    assert digest == config_check.config_digest({"seed": 1})


def _gathered(configs):
    """The rows `check_same_config` would gather from workers with `configs`."""
    return {w: config_check._row(w, config_check._fields(c, ())) for w, c in enumerate(configs)}


def _info(worker):
    return tfdp.StrategyInfo("MultiWorkerMirroredStrategy", 3, worker, worker == 0, 3,
                             ("/cpu:0",), "collective/ring")


@pytest.mark.parametrize("worker", [0, 1, 2])
def test_a_mismatch_names_the_workers_and_fields_on_every_worker(worker):
    configs = [{"model": "mlp", "seed": 0, "batch": 64},
               {"model": "mlp", "seed": 0, "batch": 64},
               {"model": "cnn", "seed": 7, "batch": 64}]
    rows = _gathered(configs)
    fields = config_check._fields(configs[worker], ())
    message = config_check._mismatch_message(_info(worker), fields, rows, [2], "d")
    assert "worker 2 differs from the chief (worker 0) in: model, seed" in message
    if worker == 0:
        assert 'This worker (0) has model="mlp", seed=0.' in message
        assert "Start every worker with identical flags" in message
    else:
        assert "same flags as the chief" in message
    if worker == 2:
        assert 'This worker (2) has model="cnn", seed=7.' in message


def test_a_mismatch_in_the_set_of_fields_suggests_different_versions():
    configs = [{"seed": 0}, {"seed": 0, "new_flag": 1}]
    rows = _gathered(configs)
    message = config_check._mismatch_message(_info(0), config_check._fields(configs[0], ()), rows,
                                        [1], "d")
    assert "worker 1 differs from the chief (worker 0) in: its set of fields" in message


# --- slow: real workers ---------------------------------------------------------

_SAME_CONFIG = """
    import os
    import tfdp
    from tfdp.distribute import config_check

    strategy = tfdp.make_strategy("multi_worker", startup_timeout=60)
    rank = int(os.environ["TFDP_RANK"])
    seed = rank if os.environ.get("DIFFERENT_SEEDS") else 0
    digest = config_check.check_same_config(strategy, {"model": "mlp", "global_batch": 64,
                                                  "seed": seed})
    print("digest", digest, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("different", [False, True], ids=["same", "different_seeds"])
def test_workers_with_different_configurations_all_fail(tmp_path, different):
    env = {"DIFFERENT_SEEDS": "1"} if different else {}
    result = run_worker_script(tmp_path, _SAME_CONFIG, env=env, timeout=150)
    if not different:
        assert result.returncode == 0, result.describe()
        digests = {tuple(result.worker_stdout(r)) for r in (0, 1)}
        assert len(digests) == 1, result.describe()
        return
    assert result.returncode != 0, result.describe()
    for rank in (0, 1):
        stderr = "\n".join(result.worker_stderr(rank))
        assert ("ConfigMismatchError: The workers' configurations differ: worker 1 differs "
                "from the chief (worker 0) in: seed.") in stderr, result.describe()
        assert f"This worker ({rank}) has seed={rank}." in stderr
    assert "Start every worker with identical flags" in "\n".join(result.worker_stderr(0))


@pytest.mark.slow
def test_tfdp_train_refuses_workers_started_with_different_seeds(tmp_path):
    # The check tfdp.app.experiment runs right after the strategy is built; nothing
    # is written to model_dir.
    command = ["sh", "-c", f'exec "{shutil.which("tfdp-train")}" --dataset=digits --model=mlp '
               f'--epochs=1 --steps_per_epoch=1 --model_dir={tmp_path / "run"} '
               f'--data_dir={tmp_path / "data"} --seed=$TFDP_RANK']
    result = run_launch(command, nproc=2, timeout=180, cwd=tmp_path)
    assert result.returncode != 0, result.describe()
    for rank in (0, 1):
        stderr = "\n".join(result.worker_stderr(rank))
        assert "worker 1 differs from the chief (worker 0) in: seed." in stderr, result.describe()
        assert f"This worker ({rank}) has seed={rank}." in stderr
    assert not (tmp_path / "run").exists()
