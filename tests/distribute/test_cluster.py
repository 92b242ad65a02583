"""Tests for `tfdp.distribute.cluster`: TF_CONFIG validation and properties."""

import copy
import json
import pickle

import pytest

from tfdp.distribute.cluster import ClusterConfig, parse_tf_config
from tfdp.distribute.local_cluster import local_tf_config


def _tf_config(cluster, task_type="worker", index=0, **extra):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


TWO_WORKERS = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}

# (id, raw TF_CONFIG, substrings the message must contain: field, rule, received)
BAD_TF_CONFIGS = [
    ("malformed_json", '{"cluster": {"worker": ["a:1"]', ["valid JSON", "Received: TF_CONFIG="]),
    ("not_an_object", '["a:1", "b:2"]', ["JSON object", "Received: TF_CONFIG="]),
    ("json_string", '"worker"', ["JSON object"]),
    ("missing_cluster", json.dumps({"task": {"type": "worker", "index": 0}}),
     ['"cluster" key', "Received: TF_CONFIG="]),
    ("missing_task", json.dumps({"cluster": TWO_WORKERS}), ['"task" key', "Received"]),
    ("task_not_object", json.dumps({"cluster": TWO_WORKERS, "task": "worker"}),
     ['TF_CONFIG["task"]', "must be an object", "Received"]),
    ("missing_task_type", json.dumps({"cluster": TWO_WORKERS, "task": {"index": 0}}),
     ['TF_CONFIG["task"]["type"]', "is missing", "Received"]),
    ("unknown_task_type", _tf_config(TWO_WORKERS, "master"),
     ['TF_CONFIG["task"]["type"]', "must be one of", "Received", "'master'"]),
    ("task_type_not_str", _tf_config(TWO_WORKERS, 0),
     ['TF_CONFIG["task"]["type"]', "must be one of", "Received"]),
    ("ps_task_type", _tf_config({**TWO_WORKERS}, "ps"),
     ["ParameterServerStrategy", "does not support", 'TF_CONFIG["task"]["type"]']),
    ("ps_job_in_cluster", _tf_config({**TWO_WORKERS, "ps": ["127.0.0.1:2224"]}),
     ["ParameterServerStrategy", "does not support", '"ps"']),
    ("unknown_job_in_cluster", _tf_config({**TWO_WORKERS, "trainer": ["127.0.0.1:2224"]}),
     ["keys must be task types", "'trainer'"]),
    ("task_type_not_in_cluster", _tf_config(TWO_WORKERS, "chief"),
     ['TF_CONFIG["task"]["type"]', "must name a job", "Received", "'chief'"]),
    ("missing_task_index", json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker"}}),
     ['TF_CONFIG["task"]["index"]', "is missing", "Received"]),
    ("index_string", _tf_config(TWO_WORKERS, "worker", "1"),
     ['TF_CONFIG["task"]["index"]', "must be an integer", "Received", "'1'"]),
    ("index_float", _tf_config(TWO_WORKERS, "worker", 1.0),
     ['TF_CONFIG["task"]["index"]', "must be an integer", "1.0"]),
    ("index_bool", _tf_config(TWO_WORKERS, "worker", True),
     ['TF_CONFIG["task"]["index"]', "must be an integer", "True"]),
    ("index_negative", _tf_config(TWO_WORKERS, "worker", -1),
     ['TF_CONFIG["task"]["index"]', "must be in [0, 1]", "Received", "=-1"]),
    ("index_out_of_range", _tf_config(TWO_WORKERS, "worker", 2),
     ['TF_CONFIG["task"]["index"]', "must be in [0, 1]", "2 worker task(s)", "=2"]),
    ("evaluator_index_out_of_range", _tf_config(TWO_WORKERS, "evaluator", 1),
     ['TF_CONFIG["task"]["index"]', "must be in [0, 0]"]),
    ("cluster_not_object", _tf_config(["127.0.0.1:2222"]),
     ['TF_CONFIG["cluster"]', "non-empty mapping", "Received"]),
    ("cluster_empty", _tf_config({}), ['TF_CONFIG["cluster"]', "non-empty mapping"]),
    ("job_not_list", _tf_config({"worker": "127.0.0.1:2222"}),
     ['TF_CONFIG["cluster"]["worker"]', "must be a list", "Received"]),
    ("job_empty", _tf_config({"worker": [], "chief": ["127.0.0.1:2222"]}),
     ['TF_CONFIG["cluster"]["worker"]', "at least one", "remove the \"worker\" key"]),
    ("address_without_port", _tf_config({"worker": ["127.0.0.1", "127.0.0.1:2223"]}),
     ['TF_CONFIG["cluster"]["worker"][0]', '"host:port"', "Received", "'127.0.0.1'"]),
    ("address_port_not_number", _tf_config({"worker": ["host:http"]}),
     ['TF_CONFIG["cluster"]["worker"][0]', "port 'http'", "[1, 65535]"]),
    ("address_port_zero", _tf_config({"worker": ["host:0"]}),
     ['["worker"][0]', "[1, 65535]", "'host:0'"]),
    ("address_port_too_big", _tf_config({"worker": ["host:65536"]}),
     ['["worker"][0]', "[1, 65535]", "'host:65536'"]),
    ("address_empty_host", _tf_config({"worker": [":2222"]}),
     ['["worker"][0]', "host part", "':2222'"]),
    ("address_space_in_host", _tf_config({"worker": ["my host:2222"]}),
     ['["worker"][0]', "host part"]),
    ("address_unbracketed_ipv6", _tf_config({"worker": ["::1:2222"]}),
     ['["worker"][0]', "IPv6 hosts need brackets"]),
    ("address_not_string", _tf_config({"worker": [2222]}),
     ['["worker"][0]', '"host:port" string', "Received"]),
    ("duplicate_address_same_job", _tf_config({"worker": ["h:2222", "h:2222"]}),
     ["must be unique", '["worker"][0]', '["worker"][1]', "'h:2222'"]),
    ("duplicate_address_across_jobs",
     _tf_config({"chief": ["h:2222"], "worker": ["h:2223", "H:2222"]}),
     ["must be unique", '["chief"][0]', '["worker"][1]']),
    ("duplicate_with_evaluator",
     _tf_config({"worker": ["h:2222"], "evaluator": ["h:2222"]}),
     ["must be unique", '["evaluator"][0]']),
    ("two_chiefs", _tf_config({"chief": ["h:1", "h:2"], "worker": ["h:3"]}),
     ['TF_CONFIG["cluster"]["chief"]', "at most one address", "Received"]),
    ("two_evaluators", _tf_config({"worker": ["h:1"], "evaluator": ["h:2", "h:3"]}),
     ['TF_CONFIG["cluster"]["evaluator"]', "at most one address", "Received"]),
    ("evaluator_only", _tf_config({"evaluator": ["h:1"]}, "evaluator"),
     ['"chief" or a "worker" job']),
    ("rpc_layer_empty", _tf_config(TWO_WORKERS, rpc_layer=""),
     ['TF_CONFIG["rpc_layer"]', "non-empty string"]),
]


@pytest.mark.parametrize("raw,expected", [case[1:] for case in BAD_TF_CONFIGS],
                         ids=[case[0] for case in BAD_TF_CONFIGS])
def test_parse_tf_config_rejects_bad_config(raw, expected):
    with pytest.raises(ValueError) as info:
        parse_tf_config(raw)
    message = str(info.value)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in error message: {message}"


@pytest.mark.parametrize("raw,expected", [case[1:] for case in BAD_TF_CONFIGS[:3]],
                         ids=[case[0] for case in BAD_TF_CONFIGS[:3]])
def test_parse_tf_config_reads_environ(raw, expected):
    with pytest.raises(ValueError, match="TF_CONFIG"):
        parse_tf_config(environ={"TF_CONFIG": raw})


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"}],
                         ids=["unset", "empty", "blank"])
def test_parse_tf_config_returns_none_without_cluster(environ):
    assert parse_tf_config(environ=environ) is None


def test_parse_tf_config_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(TWO_WORKERS, "worker", 1))
    assert parse_tf_config().task_index == 1
    monkeypatch.delenv("TF_CONFIG")
    assert parse_tf_config() is None


def test_parse_tf_config_rejects_non_string():
    with pytest.raises(TypeError, match=r"`raw` must be a TF_CONFIG JSON string"):
        parse_tf_config({"cluster": TWO_WORKERS})


# (id, cluster, task type, index, num_workers, worker_index, is_chief)
GOOD_CONFIGS = [
    ("chief", {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}, "chief", 0, 3, 0, True),
    ("worker_with_chief", {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}, "worker", 0,
     3, 1, False),
    ("last_worker_with_chief", {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}, "worker",
     1, 3, 2, False),
    ("worker0_no_chief", {"worker": ["h1:1", "h2:1"]}, "worker", 0, 2, 0, True),
    ("worker1_no_chief", {"worker": ["h1:1", "h2:1"]}, "worker", 1, 2, 1, False),
    ("chief_only", {"chief": ["h0:1"]}, "chief", 0, 1, 0, True),
    ("single_worker", {"worker": ["localhost:2222"]}, "worker", 0, 1, 0, True),
    ("evaluator_listed", {"chief": ["h0:1"], "worker": ["h1:1"], "evaluator": ["h9:1"]},
     "evaluator", 0, 2, None, False),
    ("evaluator_unlisted", {"worker": ["h1:1", "h2:1"]}, "evaluator", 0, 2, None, False),
    ("worker_beside_evaluator", {"worker": ["h1:1", "h2:1"], "evaluator": ["h9:1"]},
     "worker", 1, 2, 1, False),
    ("ipv6_and_hostnames", {"worker": ["[::1]:2222", "node-1.cluster.local:2222"]},
     "worker", 1, 2, 1, False),
]


@pytest.mark.parametrize("cluster,task_type,index,num_workers,worker_index,is_chief",
                         [case[1:] for case in GOOD_CONFIGS], ids=[c[0] for c in GOOD_CONFIGS])
def test_good_config_properties(cluster, task_type, index, num_workers, worker_index,
                                is_chief):
    config = parse_tf_config(_tf_config(cluster, task_type, index))
    assert config.task_type == task_type
    assert config.task_index == index
    assert dict(config.cluster) == {job: tuple(addrs) for job, addrs in cluster.items()}
    assert config.num_workers == num_workers
    assert config.worker_index == worker_index
    assert config.is_chief is is_chief
    # to_json() is a TF_CONFIG string that parses back to the same config.
    assert parse_tf_config(config.to_json()) == config
    assert json.loads(config.to_json()) == {"cluster": cluster,
                                            "task": {"type": task_type, "index": index}}


def test_worker_ranks_are_a_permutation():
    cluster = {"chief": ["h0:1"], "worker": [f"h{i}:1" for i in range(1, 5)],
               "evaluator": ["h9:1"]}
    configs = [ClusterConfig(cluster=cluster, task_type="chief", task_index=0)]
    configs += [ClusterConfig(cluster=cluster, task_type="worker", task_index=i)
                for i in range(4)]
    assert sorted(c.worker_index for c in configs) == list(range(5))
    assert [c.is_chief for c in configs] == [True, False, False, False, False]
    assert {c.num_workers for c in configs} == {5}


def test_matches_tensorflow_rules():
    """worker_index/num_workers/is_chief agree with TensorFlow's own helpers."""
    from tensorflow.python.distribute import multi_worker_util

    for cluster in ({"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]},
                    {"worker": ["h1:1", "h2:1", "h3:1"]}):
        tasks = [(job, i) for job in cluster for i in range(len(cluster[job]))]
        for task_type, index in tasks:
            config = ClusterConfig(cluster=cluster, task_type=task_type, task_index=index)
            assert config.worker_index == multi_worker_util.id_in_cluster(
                cluster, task_type, index)
            assert config.num_workers == multi_worker_util.worker_count(cluster, task_type)
            assert config.is_chief == multi_worker_util.is_chief(cluster, task_type, index)


def test_tensorflow_resolver_reads_to_json(monkeypatch):
    import tensorflow as tf

    config = ClusterConfig(cluster={"chief": ["h0:2222"], "worker": ["h1:2222"]},
                           task_type="worker", task_index=0, rpc_layer="grpc")
    monkeypatch.setenv("TF_CONFIG", config.to_json())
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert resolver.task_type == "worker"
    assert resolver.task_id == 0
    assert resolver.rpc_layer == "grpc"
    assert resolver.cluster_spec().as_dict() == {"chief": ["h0:2222"], "worker": ["h1:2222"]}


def test_cluster_config_is_frozen_hashable_and_picklable():
    config = ClusterConfig(cluster={"worker": ["h1:1", "h2:1"]}, task_type="worker",
                           task_index=1)
    with pytest.raises(Exception):
        config.task_index = 0
    with pytest.raises(TypeError):
        config.cluster["worker"] = ("h3:1",)
    same = ClusterConfig(cluster={"worker": ("h1:1", "h2:1")}, task_type="worker",
                         task_index=1)
    assert config == same and hash(config) == hash(same)
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config
    assert config.address == "h2:1"


def test_cluster_config_is_keyword_only():
    with pytest.raises(TypeError):
        ClusterConfig({"worker": ["h:1"]}, "worker", 0)


def test_cluster_config_validates_direct_construction():
    with pytest.raises(ValueError, match=r"`task_index` must be in \[0, 0\].*task_index=3"):
        ClusterConfig(cluster={"worker": ["h:1"]}, task_type="worker", task_index=3)
    with pytest.raises(ValueError, match=r'`cluster\["worker"\]\[1\]`.*"host:port"'):
        ClusterConfig(cluster={"worker": ["h:1", "h"]}, task_type="worker", task_index=0)
    with pytest.raises(ValueError, match=r"`rpc_layer` must be a non-empty string"):
        ClusterConfig(cluster={"worker": ["h:1"]}, task_type="worker", task_index=0,
                      rpc_layer=3)


def test_this_host_named_twice_is_refused_before_tensorflow_starts():
    # What a launcher or a hand-written TF_CONFIG gets wrong most often: two
    # workers of this machine on one port. TensorFlow would start one server
    # and hang the other worker; tfdp names both entries.
    twice = ["127.0.0.1:2222", "127.0.0.1:2222"]
    with pytest.raises(ValueError, match=r"must be unique.*'127.0.0.1:2222' is both "
                                         r'cluster\["worker"\]\[0\] and cluster\["worker"\]\[1\]'):
        ClusterConfig(cluster={"worker": twice}, task_type="worker", task_index=1)
    with pytest.raises(ValueError, match="`ports` must be distinct"):
        local_tf_config(2, 0, ports=[2222, 2222])


def test_parse_keeps_rpc_layer_and_ignores_other_keys():
    config = parse_tf_config(_tf_config(TWO_WORKERS, rpc_layer="grpc",
                                        environment="cloud"))
    assert config.rpc_layer == "grpc"
    assert json.loads(config.to_json())["rpc_layer"] == "grpc"
