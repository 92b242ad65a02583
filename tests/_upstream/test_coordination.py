"""Pins the TensorFlow internals `tfdp/_upstream/coordination.py` relies on.

When one of these fails after a TensorFlow upgrade, update that module (and
only it). What the deadline does end to end (a peer that never starts fails
every worker in time, naming its address) is tested with real workers in
`tests/distribute/test_startup.py`.
"""

import inspect

import pytest
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import collective_all_reduce_strategy

from tfdp._upstream import coordination


@pytest.fixture(autouse=True)
def _forget_the_service():
    yield
    coordination.reset_for_tests()


def test_multi_worker_strategy_keeps_a_service_configured_before_it():
    source = inspect.getsource(
        collective_all_reduce_strategy.CollectiveAllReduceExtended._initialize_multi_worker)
    assert "context.context().coordination_service is None" in source


def test_the_register_barrier_and_its_timeout_are_config_fields():
    fields = coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    assert {"cluster_register_with_barrier", "cluster_register_timeout_in_ms"} <= set(fields)


@pytest.mark.parametrize(
    "cluster, task_type, leader, jobs",
    [
        ({"worker": ["h:1", "h:2"]}, "worker", "/job:worker/replica:0/task:0", [("worker", 2)]),
        ({"chief": ["h:0"], "worker": ["h:1", "h:2"], "evaluator": ["h:3"]}, "worker",
         "/job:chief/replica:0/task:0", [("chief", 1), ("worker", 2)]),
    ],
)
def test_the_deadline_configures_the_service_multi_worker_would(cluster, task_type, leader,
                                                                jobs):
    assert coordination.configure_startup_deadline(cluster, task_type, 2.0005)
    service = coordination.context.context().coordination_service
    assert (service.service_type, service.service_leader) == ("standalone", leader)
    assert [(job.name, job.num_tasks) for job in service.coordinated_job_list] == jobs
    assert service.cluster_register_timeout_in_ms == 2001  # rounded up
    assert service.cluster_register_with_barrier and service.enable_health_check


def test_an_evaluator_and_an_already_configured_service_are_left_alone():
    cluster = {"worker": ["h:1", "h:2"], "evaluator": ["h:3"]}
    assert not coordination.configure_startup_deadline(cluster, "evaluator", 5)
    assert coordination.context.context().coordination_service is None
    assert coordination.configure_startup_deadline(cluster, "worker", 5)
    assert not coordination.configure_startup_deadline(cluster, "worker", 9)
    assert coordination.context.context().coordination_service.cluster_register_timeout_in_ms \
        == 5000
