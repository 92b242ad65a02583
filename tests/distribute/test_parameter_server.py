"""`kind="parameter_server"`'s cluster rules, plan and refusals, without starting a cluster.

The cluster itself, training on it and losing a worker are
`tests/training/test_parameter_server_training.py`'s.
"""

import json

import pytest

from tfdp.distribute import cluster as cluster_lib
from tfdp.distribute import local_cluster
from tfdp.distribute import parameter_server
from tfdp.distribute import strategy as strategy_lib
from tfdp.training import parameter_server_loop
from tfdp.training.batch import BatchConfig

CLUSTER = {"chief": ["127.0.0.1:2220"], "worker": ["127.0.0.1:2221", "127.0.0.1:2222"],
           "ps": ["127.0.0.1:2223"]}


def _config(cluster=CLUSTER, task_type="chief", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize("task_type,index", [("chief", 0), ("worker", 1), ("ps", 0)])
def test_parameter_server_cluster_is_read_with_every_role(task_type, index):
    config = parameter_server.cluster_from_environment(
        {"TF_CONFIG": _config(task_type=task_type, index=index)})
    assert (config.task_type, config.task_index) == (task_type, index)
    assert dict(config.cluster) == {job: tuple(a) for job, a in CLUSTER.items()}


@pytest.mark.parametrize("missing", ["chief", "worker", "ps"])
def test_a_missing_role_is_named(missing):
    cluster = {job: a for job, a in CLUSTER.items() if job != missing}
    task = "worker" if missing == "chief" else "chief"
    with pytest.raises(ValueError) as error:
        parameter_server.cluster_from_environment({"TF_CONFIG": _config(cluster, task)})
    assert f'needs a "{missing}" job in TF_CONFIG["cluster"]' in str(error.value)
    assert "Received: TF_CONFIG[\"cluster\"]=" in str(error.value)


def test_unset_tf_config_says_what_to_set():
    with pytest.raises(ValueError, match="needs a cluster: set TF_CONFIG on every task"):
        parameter_server.cluster_from_environment({})


def test_mirrored_kinds_still_refuse_ps_and_point_at_parameter_server():
    with pytest.raises(ValueError) as error:
        cluster_lib.parse_tf_config(_config())
    message = str(error.value)
    assert "ParameterServerStrategy" in message and "does not support" in message
    assert "kind='parameter_server'" in message


def test_serve_refuses_the_chief():
    config = cluster_lib.parse_tf_config(_config(), parameter_server=True)
    with pytest.raises(ValueError, match="this task is the 'chief'"):
        parameter_server.serve(config)


def test_server_threads_cover_every_worker_and_one_more():
    config = cluster_lib.parse_tf_config(_config(task_type="ps"), parameter_server=True)
    assert parameter_server.server_config(config).inter_op_parallelism_threads >= 3


@pytest.mark.parametrize("kwargs,named", [
    (dict(cpu_replicas=2), "cpu_replicas=2 cannot apply"),
    (dict(communication="ring"), "communication='ring'"),
    (dict(bytes_per_pack=1024, timeout_seconds=5.0), "bytes_per_pack=1024, timeout_seconds=5.0"),
])
def test_plan_refuses_arguments_of_the_all_reduce(kwargs, named):
    with pytest.raises(ValueError) as error:
        strategy_lib.plan_strategy("parameter_server", num_gpus=0, **kwargs)
    assert named in str(error.value)


def test_plan_of_parameter_server():
    plan = strategy_lib.plan_strategy("parameter_server", num_gpus=0)
    assert plan.kind == "parameter_server" and plan.num_replicas == 1 and not plan.warnings


def test_local_parameter_server_configs():
    configs = local_cluster.parameter_server_tf_configs(2, 1, ports=[5000, 5001, 5002, 5003])
    assert [c["task"] for c in configs] == [
        {"type": "chief", "index": 0}, {"type": "worker", "index": 0},
        {"type": "worker", "index": 1}, {"type": "ps", "index": 0}]
    assert configs[0]["cluster"] == {"chief": ["127.0.0.1:5000"],
                                     "worker": ["127.0.0.1:5001", "127.0.0.1:5002"],
                                     "ps": ["127.0.0.1:5003"]}
    with pytest.raises(ValueError, match="must be 4 distinct ports"):
        local_cluster.parameter_server_tf_configs(2, 1, ports=[5000, 5001, 5002, 5002])


@pytest.mark.parametrize("option,value", [
    ("sync_every", 4), ("all_reduce_dtype", "bfloat16"), ("shard_optimizer_state", True),
    ("balance_batches", True),
])
def test_trainer_options_of_the_all_reduce_are_refused_by_name(option, value):
    options = dict(parameter_server_loop._SYNCHRONOUS_OPTIONS, **{option: value})
    with pytest.raises(ValueError) as error:
        parameter_server_loop.check_options(batch=BatchConfig(32, 1), **options)
    assert f"{option}={value!r} cannot apply" in str(error.value)


def test_trainer_refuses_accumulation():
    with pytest.raises(ValueError, match="accum_steps=2"):
        parameter_server_loop.check_options(batch=BatchConfig(16, 1, 2),
                                            **parameter_server_loop._SYNCHRONOUS_OPTIONS)
