"""Tests for tfdp.distribute.strategy: the strategy decision, building, and strategy_info."""

import json
import socket
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.distribute import local_cluster
from tfdp.distribute import startup
from tfdp.distribute import strategy as strategy_lib
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp._upstream import coordination


@pytest.fixture(autouse=True)
def _no_coordination_service_left_configured(monkeypatch):
    """Tests that build a (recorded) multi-worker strategy configure this process's
    coordination service; forget it, and read no start-up timeout from outside."""
    monkeypatch.delenv(startup.STARTUP_TIMEOUT_ENV, raising=False)
    yield
    coordination.reset_for_tests()


# --- plan_strategy: every branch, GPUs faked by count -----------------------

@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(num_gpus=0), dict(kind="default", num_replicas=1)),
        (dict(num_gpus=1), dict(kind="default", num_replicas=1)),
        (dict(num_gpus=0, cpu_replicas=1), dict(kind="default")),
        (
            dict(num_gpus=0, cpu_replicas=2),
            dict(kind="mirrored", devices=("/cpu:0", "/cpu:1"), cross_device_ops="collective",
                 num_replicas=2),
        ),
        (
            dict(num_gpus=4),
            dict(kind="mirrored", devices=None, cross_device_ops="nccl", num_packs=1,
                 num_replicas=4),
        ),
        (
            dict(num_gpus=8, num_packs=4),
            dict(kind="mirrored", cross_device_ops="nccl", num_packs=4),
        ),
        (
            dict(kind="mirrored", num_gpus=4, cross_device_ops="hierarchical_copy", num_packs=2),
            dict(kind="mirrored", cross_device_ops="hierarchical_copy", num_packs=2),
        ),
        (
            dict(kind="mirrored", num_gpus=2, cross_device_ops="reduce_to_one"),
            dict(kind="mirrored", cross_device_ops="reduce_to_one"),
        ),
        (
            dict(kind="mirrored", num_gpus=1),
            dict(kind="mirrored", devices=None, cross_device_ops="reduce_to_one"),
        ),
        (
            dict(num_gpus=0, num_workers=2),
            dict(kind="multi_worker", communication="auto", num_replicas=2,
                 bytes_per_pack=strategy_lib.CPU_BYTES_PER_PACK),
        ),
        (  # 4 MiB packs are the default on CPU workers only
            dict(num_gpus=2, num_workers=2),
            dict(kind="multi_worker", bytes_per_pack=0, num_replicas=4),
        ),
        (  # 0 is TensorFlow's one pack, also on CPU workers
            dict(num_gpus=0, num_workers=2, bytes_per_pack=0),
            dict(kind="multi_worker", bytes_per_pack=0),
        ),
        (
            dict(num_gpus=2, num_workers=2, communication="nccl", bytes_per_pack=1 << 20,
                 timeout_seconds=30),
            dict(kind="multi_worker", communication="nccl", bytes_per_pack=1 << 20,
                 timeout_seconds=30, warnings=(), num_replicas=4),
        ),
        (
            dict(kind="multi_worker", num_gpus=0, communication="ring"),
            dict(kind="multi_worker", communication="ring"),
        ),
        (dict(kind="one_device", num_gpus=0), dict(kind="one_device", devices=("/cpu:0",))),
        (dict(kind="one_device", num_gpus=2), dict(kind="one_device", devices=("/gpu:0",))),
    ],
)
def test_plan_strategy_choices(kwargs, expected):
    plan = strategy_lib.plan_strategy(**kwargs)
    for field, value in expected.items():
        assert getattr(plan, field) == value, (field, plan)


@pytest.mark.parametrize("ops", ["nccl", "hierarchical_copy"])
def test_plan_gpu_only_cross_device_ops_fall_back_on_cpu_with_a_warning(ops):
    plan = strategy_lib.plan_strategy(
        "mirrored", num_gpus=0, cpu_replicas=2, cross_device_ops=ops
    )
    assert plan.cross_device_ops == "collective"
    assert len(plan.warnings) == 1 and ops in plan.warnings[0]


def test_plan_nccl_communication_falls_back_to_ring_without_gpus():
    plan = strategy_lib.plan_strategy("multi_worker", num_gpus=0, communication="nccl")
    assert plan.communication == "ring"
    assert len(plan.warnings) == 1 and "ring" in plan.warnings[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="tpu"), "`kind` must be one of"),
        (dict(cross_device_ops="nvlink"), "`cross_device_ops` must be one of"),
        (dict(communication="mpi"), "`communication` must be one of"),
        (dict(cpu_replicas=0), "`cpu_replicas` must be a positive integer"),
        (dict(cpu_replicas=2.0), "`cpu_replicas` must be a positive integer"),
        (dict(num_packs=0), "`num_packs` must be a positive integer"),
        (dict(bytes_per_pack=-1), "`bytes_per_pack` must be an integer >= 0"),
        (dict(timeout_seconds=0), "`timeout_seconds` must be a positive"),
        (dict(timeout_seconds="10"), "`timeout_seconds` must be a positive"),
        (dict(startup_timeout=0), "`startup_timeout` must be a positive"),
        (dict(startup_timeout=float("inf")), "`startup_timeout` must be a positive"),
        (dict(cpu_replicas=2, num_gpus=2), "this host has 2 GPU"),
        (dict(kind="mirrored", num_workers=2), "describes 2 workers"),
        (dict(kind="default", cpu_replicas=2), "Use kind='mirrored'"),
        (dict(kind="one_device", cpu_replicas=2), "Use kind='mirrored'"),
        (dict(kind="multi_worker", cpu_replicas=2), "Start more workers"),
    ],
)
def test_plan_rejects_bad_arguments_with_the_fix(kwargs, message):
    kwargs.setdefault("num_gpus", 0)
    with pytest.raises(ValueError, match=message) as error:
        strategy_lib.plan_strategy(**kwargs)
    assert "Received" in str(error.value) or "Use" in str(error.value) or "Remove" in str(
        error.value
    ) or "Start" in str(error.value) or "unset" in str(error.value)


# --- building: GPU paths with the physical device list faked ----------------

class _FakeGPU:
    def __init__(self, index):
        self.name = f"/physical_device:GPU:{index}"
        self.device_type = "GPU"


def _fake_gpus(monkeypatch, count):
    real = tf.config.list_physical_devices

    def fake(device_type=None):
        if device_type == "GPU":
            return [_FakeGPU(i) for i in range(count)]
        return real(device_type)

    monkeypatch.setattr(tf.config, "list_physical_devices", fake)


@pytest.mark.parametrize(
    "cross_device_ops, num_packs, expected_type",
    [
        ("auto", 1, tf.distribute.NcclAllReduce),
        ("nccl", 3, tf.distribute.NcclAllReduce),
        ("hierarchical_copy", 2, tf.distribute.HierarchicalCopyAllReduce),
        ("reduce_to_one", 1, tf.distribute.ReductionToOneDevice),
    ],
)
def test_make_strategy_on_faked_gpus_passes_the_chosen_cross_device_ops(
    monkeypatch, cross_device_ops, num_packs, expected_type
):
    _fake_gpus(monkeypatch, 4)
    built = {}

    class RecordingMirroredStrategy:
        _collective_key_base = 0

        def __init__(self, devices=None, cross_device_ops=None):
            built.update(devices=devices, cross_device_ops=cross_device_ops)

    monkeypatch.setattr(tf.distribute, "MirroredStrategy", RecordingMirroredStrategy)
    monkeypatch.setattr(strategy_lib, "strategy_info", lambda s: _not_chief())
    tfdp.make_strategy(cross_device_ops=cross_device_ops, num_packs=num_packs)
    assert built["devices"] is None  # every local GPU
    assert isinstance(built["cross_device_ops"], expected_type)
    if expected_type is not tf.distribute.ReductionToOneDevice:
        assert built["cross_device_ops"]._num_packs == num_packs


def _not_chief():
    return strategy_info_lib.StrategyInfo("X", 1, 0, False, 4, (), "nccl")


_PORTS = local_cluster.free_ports(2)


def _two_worker_tf_config(index=0, ports=_PORTS):
    return json.dumps(local_cluster.local_tf_config(2, index, ports=list(ports)))


def test_auto_reads_a_multi_worker_tf_config_from_the_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _two_worker_tf_config(1))
    plan = strategy_lib.plan_from_environment()
    assert (plan.kind, plan.num_replicas) == ("multi_worker", 2)
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["127.0.0.1:20001"]}, "task": {"type": "worker", "index": 0}}))
    assert strategy_lib.plan_from_environment().kind == "default"


def test_make_strategy_refuses_a_malformed_tf_config_naming_the_field(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["127.0.0.1:20001"]}, "task": {"type": "worker", "index": 3}}))
    with pytest.raises(ValueError, match="index"):
        tfdp.make_strategy()


@pytest.mark.parametrize(
    "communication, gpus, expected",
    [
        ("auto", 0, "AUTO"),
        ("ring", 2, "RING"),
        ("nccl", 2, "NCCL"),
        ("nccl", 0, "RING"),  # no GPU on this worker: falls back, with a warning
    ],
)
def test_make_strategy_passes_communication_options_to_multi_worker(
    monkeypatch, communication, gpus, expected
):
    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setenv("TF_CONFIG", _two_worker_tf_config())
    built = {}

    class RecordingMultiWorkerMirroredStrategy:
        def __init__(self, cluster_resolver=None, communication_options=None):
            built.update(resolver=cluster_resolver, options=communication_options)

    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                        RecordingMultiWorkerMirroredStrategy)
    monkeypatch.setattr(strategy_lib, "strategy_info", lambda s: _not_chief())
    tfdp.make_strategy(communication=communication, bytes_per_pack=1 << 20,
                       timeout_seconds=30.0)
    options = built["options"]
    assert options.implementation == getattr(
        tf.distribute.experimental.CommunicationImplementation, expected)
    assert (options.bytes_per_pack, options.timeout_seconds) == (1 << 20, 30.0)
    assert built["resolver"].cluster_spec().as_dict() == {
        "worker": [f"127.0.0.1:{port}" for port in _PORTS]}


def _record_multi_worker(monkeypatch):
    built = []
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                        lambda **kwargs: built.append(kwargs) or "built")
    monkeypatch.setattr(strategy_lib, "strategy_info", lambda s: _not_chief())
    return built


@pytest.mark.parametrize(
    "argument, environ, expected",
    [(None, None, startup.DEFAULT_STARTUP_TIMEOUT), (None, "7", 7.0), (4, "7", 4.0)],
)
def test_the_startup_timeout_plan_comes_from_the_argument_then_the_environment(
    monkeypatch, argument, environ, expected
):
    monkeypatch.setenv("TF_CONFIG", _two_worker_tf_config())
    if environ is not None:
        monkeypatch.setenv(startup.STARTUP_TIMEOUT_ENV, environ)
    assert strategy_lib.plan_from_environment(startup_timeout=argument).startup_timeout == expected


def test_a_bad_startup_timeout_variable_fails_before_anything_is_built(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _two_worker_tf_config())
    monkeypatch.setenv(startup.STARTUP_TIMEOUT_ENV, "later")
    built = _record_multi_worker(monkeypatch)
    with pytest.raises(ValueError, match="TFDP_STARTUP_TIMEOUT must be a positive"):
        tfdp.make_strategy()
    assert built == []


def test_make_strategy_sets_the_startup_deadline_in_the_coordination_service(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _two_worker_tf_config(1))
    built = _record_multi_worker(monkeypatch)
    assert tfdp.make_strategy(startup_timeout=7.5) == "built" and len(built) == 1
    service = coordination.context.context().coordination_service
    assert service.cluster_register_timeout_in_ms == 7500
    assert service.cluster_register_with_barrier
    assert service.service_leader == "/job:worker/replica:0/task:0"
    assert [(job.name, job.num_tasks) for job in service.coordinated_job_list] == [("worker", 2)]


def test_make_strategy_refuses_a_taken_port_before_building(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        monkeypatch.setenv("TF_CONFIG", _two_worker_tf_config(0, ports=(port, _PORTS[1])))
        built = _record_multi_worker(monkeypatch)
        with pytest.raises(startup.StartupError, match=f"cannot listen on port {port}"):
            tfdp.make_strategy()
    assert built == []


def test_make_strategy_rejects_cpu_replicas_on_a_gpu_host(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match="this host has 2 GPU"):
        tfdp.make_strategy(cpu_replicas=2)


# --- building on logical CPUs -----------------------------------------------

@pytest.mark.parametrize("replicas", [2, 4])
def test_make_strategy_cpu_replicas_mirrors_over_logical_cpus(replicas):
    strategy = tfdp.make_strategy(cpu_replicas=replicas)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == replicas
    info = tfdp.strategy_info(strategy)
    assert info == tfdp.StrategyInfo(
        strategy="MirroredStrategy",
        num_workers=1,
        worker_index=0,
        is_chief=True,
        num_replicas_in_sync=replicas,
        devices=tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(replicas)),
        all_reduce="collective/ring",
    )


@pytest.mark.parametrize(
    "cross_device_ops, all_reduce", [("nccl", "collective/ring"), ("reduce_to_one", "reduce_to_one")]
)
def test_cpu_cross_device_ops_all_reduce_correctly(cross_device_ops, all_reduce, caplog):
    strategy = tfdp.make_strategy(cpu_replicas=2, cross_device_ops=cross_device_ops)
    assert tfdp.strategy_info(strategy).all_reduce == all_reduce

    def replica_value():
        ctx = tf.distribute.get_replica_context()
        return tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) * tf.ones([3])

    @tf.function
    def all_reduce_sum():
        per_replica = strategy.run(replica_value)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    np.testing.assert_allclose(all_reduce_sum().numpy(), [3.0, 3.0, 3.0])


def test_nccl_fallback_warns_once(monkeypatch):
    messages = []
    monkeypatch.setattr(
        strategy_lib.logging, "warning", lambda fmt, *args: messages.append(fmt % args)
    )
    tfdp.make_strategy(cpu_replicas=2, cross_device_ops="nccl")
    assert len(messages) == 1
    assert "needs GPUs" in messages[0] and "falling back" in messages[0]


def test_chief_logs_strategy_info_once(monkeypatch):
    messages = []
    monkeypatch.setattr(
        strategy_lib.logging, "info", lambda fmt, *args: messages.append(fmt % args)
    )
    tfdp.make_strategy(cpu_replicas=2)
    strategy_lines = [m for m in messages if m.startswith("tfdp strategy:")]
    assert len(strategy_lines) == 1
    assert "2 replica(s) in sync" in strategy_lines[0]
    assert "collective/ring" in strategy_lines[0]


@pytest.mark.parametrize(
    "kind, expected_type",
    [("default", type(tf.distribute.get_strategy())), ("one_device", tf.distribute.OneDeviceStrategy)],
)
def test_single_replica_kinds(kind, expected_type):
    strategy = tfdp.make_strategy(kind)
    assert isinstance(strategy, expected_type)
    info = tfdp.strategy_info(strategy)
    assert (info.num_replicas_in_sync, info.num_workers, info.is_chief) == (1, 1, True)
    assert info.all_reduce == "none"
    assert info.strategy == {"default": "default", "one_device": "OneDeviceStrategy"}[kind]
    assert len(info.devices) == 1 and "CPU:0" in info.devices[0]


def test_cpu_replicas_after_initialisation_names_the_problem():
    # conftest initialised TensorFlow with 4 logical CPUs: 8 cannot be had now.
    with pytest.raises(RuntimeError, match="already initialised its devices with 4") as error:
        tfdp.make_strategy(cpu_replicas=8)
    assert "at the start of the program" in str(error.value)


@pytest.mark.slow
def test_cpu_replicas_after_initialisation_in_a_fresh_process():
    script = textwrap.dedent(
        """
        import tensorflow as tf
        import tfdp
        tf.constant(1.0) + 1.0  # initialises the runtime with one CPU device
        try:
            tfdp.make_strategy(cpu_replicas=2)
        except RuntimeError as error:
            print("ERROR:", error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ERROR: cpu_replicas=2 needs 2 logical CPU devices" in result.stdout
    assert "already initialised its devices with 1" in result.stdout


# --- data-parallel equivalence ----------------------------------------------

GLOBAL_BATCH = 16
STEPS = 5


def _equivalence_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
    y = rng.integers(0, 3, size=(GLOBAL_BATCH * STEPS,)).astype("int32")
    return x, y


def _train_weights(strategy):
    x, y = _equivalence_data()
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    initial = [w.numpy() for w in model.weights]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    return initial, [w.numpy() for w in model.weights], history.history["loss"][0]


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4])
def test_n_replicas_train_like_one_device(replicas):
    initial, reference, reference_loss = _train_weights(tfdp.make_strategy("one_device"))
    mirrored_initial, mirrored, mirrored_loss = _train_weights(
        tfdp.make_strategy(cpu_replicas=replicas)
    )
    for start, mirrored_start in zip(initial, mirrored_initial):
        np.testing.assert_array_equal(mirrored_start, start)
    for start, ref, got in zip(initial, reference, mirrored):
        assert np.abs(ref - start).max() > 1e-3  # training moved every weight
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(mirrored_loss, reference_loss, rtol=1e-5)
