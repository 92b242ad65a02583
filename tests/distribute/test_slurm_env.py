"""Tests for `tfdp.distribute.slurm_env` and the Slurm path of `tfdp.distribute.strategy`.

The Slurm environment is faked: the variables `srun` sets for each task of a
2-node x 2-task job step. One slow test runs two real TensorFlow workers
that find each other through that environment alone (no TF_CONFIG).
"""

import io
import os
import sys

import pytest
import tensorflow as tf

from tfdp.launch.worker_group import WorkerGroup, WorkerSpec
from multiworker import REPO_ROOT, assert_processes_gone, free_port_pair, write_worker_script
from tfdp.distribute import slurm_env
from tfdp.distribute import strategy as strategy_lib


def step_environ(procid, *, nodelist="node[01-02]", tasks_per_node="2(x2)", nodes=None,
                 num_tasks=4, job_id="4242", **extra):
    """What `srun --nodes 2 --ntasks-per-node 2` sets for task `procid` (block layout)."""
    nodes = nodes or slurm_env.expand_hostlist(nodelist)
    counts = slurm_env.expand_tasks_per_node(tasks_per_node)
    first, node, local = 0, None, None
    for name, count in zip(nodes, counts):
        if procid < first + count:
            node, local = name, procid - first
            break
        first += count
    environ = {
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(num_tasks),
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
        "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_STEP_NUM_TASKS": str(num_tasks),
        "SLURM_STEP_NUM_NODES": str(len(nodes)), "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(local), "SLURMD_NODENAME": node,
    }
    environ.update(extra)
    return environ


# -- hostlists and tasks per node --------------------------------------------

@pytest.mark.parametrize(
    "hostlist,expected",
    [
        ("node01", ["node01"]),
        ("node[01-03],gpu5", ["node01", "node02", "node03", "gpu5"]),
        ("n[1-2,5],m7", ["n1", "n2", "n5", "m7"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a.b.c,10.0.0.[1-2]", ["a.b.c", "10.0.0.1", "10.0.0.2"]),
        ("localhost", ["localhost"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert slurm_env.expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    "hostlist,fragment",
    [
        ("", "must name at least one node"),
        ("node[01-03", "unbalanced or nested brackets"),
        ("node01]", "unbalanced or nested brackets"),
        ("node[a-b]", "must be numbers or 'lo-hi' ranges"),
        ("node[]", "must be numbers or 'lo-hi' ranges"),
        ("node[5-3]", "goes backwards"),
        ("a,,b", "empty entry"),
    ],
)
def test_expand_hostlist_rejects_malformed(hostlist, fragment):
    with pytest.raises(ValueError) as info:
        slurm_env.expand_hostlist(hostlist)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "text,expected",
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])],
)
def test_expand_tasks_per_node(text, expected):
    assert slurm_env.expand_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2x3", "a", "2(x3"])
def test_expand_tasks_per_node_rejects_malformed(text):
    with pytest.raises(ValueError, match="Received part"):
        slurm_env.expand_tasks_per_node(text)


# -- ports ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"SLURM_JOB_ID": "4242"}, 10000 + 10 * (4242 % 2000)),
        ({"SLURM_JOB_ID": "4242", "SLURM_STEP_RESV_PORTS": "12000-12003"}, 12000),
        ({"SLURM_JOB_ID": "1", "SLURM_STEP_RESV_PORTS": "12000-12003",
          "TFDP_SLURM_PORT_BASE": "23456"}, 23456),
        ({}, 8888),
    ],
)
def test_port_base_sources(environ, expected):
    assert slurm_env.port_base(environ, tasks_per_node=2) == expected


@pytest.mark.parametrize(
    "environ,fragment",
    [
        ({"TFDP_SLURM_PORT_BASE": "http"}, "must be a port number"),
        ({"TFDP_SLURM_PORT_BASE": "65535"}, "must be in [1, 65534]"),
        ({"SLURM_STEP_RESV_PORTS": "12000"}, "reserves 1 port(s) per node, but a node runs 2"),
        ({"SLURM_STEP_RESV_PORTS": "ports"}, "must look like '12000-12015'"),
    ],
)
def test_port_base_rejects_bad_values(environ, fragment):
    with pytest.raises(ValueError) as info:
        slurm_env.port_base(environ, tasks_per_node=2)
    assert fragment in str(info.value)


# -- the cluster of a 2-node x 2-task job step --------------------------------

def test_two_by_two_step_gives_every_task_the_same_cluster_and_its_own_rank():
    base = slurm_env.port_base({"SLURM_JOB_ID": "4242"})
    expected = [f"node01:{base}", f"node01:{base + 1}", f"node02:{base}", f"node02:{base + 1}"]
    configs = [slurm_env.cluster_config(step_environ(rank)) for rank in range(4)]
    for rank, config in enumerate(configs):
        assert config.cluster == {"worker": tuple(expected)}
        assert (config.task_type, config.task_index, config.worker_index) == ("worker", rank, rank)
        assert config.num_workers == 4
        assert config.address == expected[rank]
    assert [c.is_chief for c in configs] == [True, False, False, False]


def test_uneven_tasks_per_node_follow_the_node_list_order():
    environ = step_environ(3, nodelist="n[9-10]", tasks_per_node="3,1", num_tasks=4,
                           TFDP_SLURM_PORT_BASE="5000")
    config = slurm_env.cluster_config(environ)
    assert config.cluster["worker"] == ("n9:5000", "n9:5001", "n9:5002", "n10:5000")
    assert config.address == "n10:5000"


@pytest.mark.parametrize(
    "environ",
    [
        {},
        # A batch script (or salloc shell) of a 4-task job: one process, no step.
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n[1-2]",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "0"},
    ],
    ids=["no_slurm", "batch_script"],
)
def test_outside_a_job_step_there_is_no_cluster(environ):
    assert slurm_env.cluster_config(environ) is None
    assert strategy_lib._num_workers(environ) == 1
    assert strategy_lib._cluster_resolver(environ) is None


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"SLURM_PROCID": None}, "SLURM_PROCID is not set"),
        ({"SLURM_STEP_NODELIST": None}, "SLURM_STEP_NODELIST is not set"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID must be an integer >= 0. Received: SLURM_PROCID='x'"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID must be in [0, 3]"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "names 2 node(s) but SLURM_STEP_TASKS_PER_NODE"),
        ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, "adds up to 6 task(s), but SLURM_STEP_NUM_TASKS=4"),
        ({"SLURM_STEP_NODELIST": "node01,node01"}, "must name each node once"),
        # --distribution=cyclic: rank 1 runs on node02 as its local task 0.
        ({"SLURM_LOCALID": "0", "SLURMD_NODENAME": "node02"},
         "should be local task 1 on node 'node01', but SLURM_LOCALID=0"),
        ({"SLURMD_NODENAME": "node02"}, "should run on node 'node01'"),
    ],
)
def test_malformed_step_environments_name_the_variable(changes, fragment):
    environ = step_environ(1)
    for name, value in changes.items():
        if value is None:
            environ.pop(name)
        else:
            environ[name] = value
    with pytest.raises(ValueError) as info:
        slurm_env.cluster_config(environ)
    assert fragment in str(info.value)


def test_cyclic_distribution_error_says_how_to_fix_it():
    environ = step_environ(1, SLURM_LOCALID="0", SLURMD_NODENAME="node02")
    with pytest.raises(ValueError, match="srun --distribution=block"):
        slurm_env.cluster_config(environ)


# -- tfdp.distribute.strategy on a Slurm step ---------------------------------------------

def test_strategy_resolves_the_slurm_step_without_tf_config():
    environ = step_environ(2)
    resolver = strategy_lib._cluster_resolver(environ)
    base = slurm_env.port_base(environ)
    assert resolver.cluster_spec().as_dict() == {"worker": [
        f"node01:{base}", f"node01:{base + 1}", f"node02:{base}", f"node02:{base + 1}"]}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 2, "grpc")
    # MultiWorkerMirroredStrategy reads the local GPU count from the resolver.
    assert resolver.num_accelerators() == {"GPU": len(tf.config.list_physical_devices("GPU"))}
    assert strategy_lib._num_workers(environ) == 4


def test_make_strategy_plans_multi_worker_inside_a_slurm_step(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in step_environ(1).items():
        monkeypatch.setenv(name, value)
    plan = strategy_lib.plan_from_environment()
    assert plan.kind == "multi_worker"
    assert plan.num_replicas == 4
    with pytest.raises(ValueError, match="describes 4 workers"):
        strategy_lib.plan_from_environment("mirrored")


def test_tf_config_takes_precedence_over_slurm():
    environ = step_environ(1, TF_CONFIG='{"cluster": {"worker": ["a:1", "b:2"]}, '
                                        '"task": {"type": "worker", "index": 0}}')
    assert strategy_lib._num_workers(environ) == 2
    assert isinstance(strategy_lib._cluster_resolver(environ),
                      tf.distribute.cluster_resolver.TFConfigClusterResolver)


# -- why not TensorFlow's SlurmClusterResolver (fails when upstream is fixed) ---

def _tf_slurm_resolver(monkeypatch, environ, **kwargs):
    for name in [n for n in os.environ if n.startswith("SLURM")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return tf.distribute.cluster_resolver.SlurmClusterResolver(**kwargs)


def test_upstream_slurm_resolver_still_fails_on_cpu_only_nodes(monkeypatch):
    with pytest.raises(ValueError, match="must not be zero"):
        resolver = _tf_slurm_resolver(monkeypatch, step_environ(0), gpus_per_node=0)
        resolver.cluster_spec()


def test_upstream_slurm_resolver_still_misorders_nodes_9_and_10(monkeypatch):
    environ = step_environ(0, nodelist="n[9-10]", TFDP_SLURM_PORT_BASE="8888")
    # Fake GPUs so that the upstream resolver runs at all.
    resolver = _tf_slurm_resolver(monkeypatch, environ, gpus_per_node=2, gpus_per_task=1,
                                  auto_set_gpu=False)
    upstream = resolver.cluster_spec().as_dict()["worker"]
    ours = list(slurm_env.cluster_config(environ).cluster["worker"])
    assert ours == ["n9:8888", "n9:8889", "n10:8888", "n10:8889"]  # rank 0 runs on n9
    assert upstream == ["n10:8888", "n10:8889", "n9:8888", "n9:8889"]
    # Where upstream orders correctly, both agree.
    environ = step_environ(0, TFDP_SLURM_PORT_BASE="8888")
    resolver = _tf_slurm_resolver(monkeypatch, environ, gpus_per_node=2, gpus_per_task=1,
                                  auto_set_gpu=False)
    assert resolver.cluster_spec().as_dict()["worker"] == list(
        slurm_env.cluster_config(environ).cluster["worker"])


# -- two real workers that find each other through Slurm's variables -----------

ALL_REDUCE_WORKER = """
import tensorflow as tf
import tfdp

strategy = tfdp.make_strategy("multi_worker")
total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                        strategy.run(lambda: tf.constant(1.0)), axis=None)
info = tfdp.strategy_info(strategy)
print(f"all-reduce {float(total)} worker {info.worker_index} of {info.num_workers}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_workers_all_reduce_inside_a_faked_slurm_step(tmp_path):
    script = write_worker_script(tmp_path, ALL_REDUCE_WORKER)
    base = free_port_pair()
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM") and k != "TF_CONFIG"}
    environ.update(PYTHONPATH=str(REPO_ROOT), TF_CPP_MIN_LOG_LEVEL="2",
                   KERAS_BACKEND="tensorflow")
    specs = [WorkerSpec(rank=rank, command=(sys.executable, "-u", str(script)),
                        env={**environ, **step_environ(rank, nodelist="localhost",
                                                       tasks_per_node="2", num_tasks=2,
                                                       TFDP_SLURM_PORT_BASE=str(base))})
             for rank in range(2)]
    out, err = io.BytesIO(), io.BytesIO()
    with WorkerGroup(specs, stdout=out, stderr=err) as group:
        group.start()
        pids = list(group.pids.values())
        # On a hang, pytest-timeout interrupts supervise() and leaving the
        # `with` block SIGKILLs and reaps both workers.
        result = group.supervise(grace_period=2.0)
    assert_processes_gone(pids)
    text = out.getvalue().decode(errors="replace")
    assert result.exit_code == 0, text + err.getvalue().decode(errors="replace")[-5000:]
    assert sorted(line for line in text.splitlines() if "all-reduce" in line) == [
        "[0] all-reduce 2.0 worker 0 of 2", "[1] all-reduce 2.0 worker 1 of 2"]


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "17"}, None),
        ({"SLURM_NTASKS": "8"}, 8),
        ({"SLURM_NPROCS": "3"}, 3),
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "8"}, 4),
        ({"SLURM_STEP_NUM_TASKS": "", "SLURM_NTASKS": "2"}, 2),
    ],
)
def test_slurm_num_tasks(environ, expected):
    assert slurm_env.slurm_num_tasks(environ) == expected


@pytest.mark.parametrize("value", ["0", "-1", "four", "2(x3)"])
def test_slurm_num_tasks_rejects_garbage(value):
    with pytest.raises(ValueError, match=r"SLURM_NTASKS must be a positive integer.*Received"):
        slurm_env.slurm_num_tasks({"SLURM_NTASKS": value})


def test_slurm_num_tasks_defaults_to_os_environ(monkeypatch):
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        monkeypatch.delenv(name, raising=False)
    assert slurm_env.slurm_num_tasks() is None
    monkeypatch.setenv("SLURM_NTASKS", "6")
    assert slurm_env.slurm_num_tasks() == 6
