"""Tests for a worker's GPUs: memory growth, and the GPUs `strategy_info` shows.

No GPU is needed: memory growth is checked on faked GPU devices (what
TensorFlow is asked to do, and when), and the visible GPUs are read from
`CUDA_VISIBLE_DEVICES`, which the launcher sets per worker.
"""

import pytest
import tensorflow as tf

import tfdp
from tfdp.distribute import devices
from tfdp.distribute import strategy as strategy_lib
from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.distribute import visible_gpus
from multiworker import run_worker_script


class _FakeGPU:
    def __init__(self, index):
        self.name = f"/physical_device:GPU:{index}"
        self.device_type = "GPU"


def _fake_gpus(monkeypatch, count, *, initialised=False, growth_already=False):
    """Fakes `count` GPUs; returns the list of TensorFlow calls made on them."""
    calls = []
    real = tf.config.list_physical_devices

    def list_physical_devices(device_type=None):
        if device_type == "GPU":
            return [_FakeGPU(i) for i in range(count)]
        return real(device_type)

    def set_memory_growth(device, enable):
        if initialised:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        calls.append(("set_memory_growth", device.name, enable))

    monkeypatch.setattr(tf.config, "list_physical_devices", list_physical_devices)
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", set_memory_growth)
    monkeypatch.setattr(tf.config.experimental, "get_memory_growth",
                        lambda device: growth_already)
    return calls


def _record_mirrored(monkeypatch, calls):
    class RecordingMirroredStrategy:
        _collective_key_base = 0

        def __init__(self, devices=None, cross_device_ops=None):
            calls.append(("MirroredStrategy",))

    monkeypatch.setattr(tf.distribute, "MirroredStrategy", RecordingMirroredStrategy)
    monkeypatch.setattr(strategy_lib, "strategy_info", lambda s: strategy_info_lib.StrategyInfo(
        "X", 1, 0, False, 2, (), "nccl"))


# --- memory growth ------------------------------------------------------------------

def test_memory_growth_is_set_on_every_gpu_before_the_strategy_is_built(monkeypatch):
    calls = _fake_gpus(monkeypatch, 2)
    _record_mirrored(monkeypatch, calls)
    tfdp.make_strategy(memory_growth=True)
    assert calls == [
        ("set_memory_growth", "/physical_device:GPU:0", True),
        ("set_memory_growth", "/physical_device:GPU:1", True),
        ("MirroredStrategy",),
    ]


def test_memory_growth_is_off_by_default_as_in_tensorflow(monkeypatch):
    calls = _fake_gpus(monkeypatch, 2)
    _record_mirrored(monkeypatch, calls)
    tfdp.make_strategy()
    assert calls == [("MirroredStrategy",)]
    assert strategy_lib.plan_strategy(num_gpus=2).memory_growth is False
    assert strategy_lib.plan_strategy(num_gpus=2, memory_growth=True).memory_growth is True


def test_memory_growth_after_the_gpus_are_initialised_says_when_to_call_it(monkeypatch):
    _fake_gpus(monkeypatch, 1, initialised=True)
    with pytest.raises(RuntimeError, match=r"before TensorFlow initialises its GPUs.*"
                                           r"TF_FORCE_GPU_ALLOW_GROWTH=true"):
        devices.configure_gpu_memory_growth()


def test_memory_growth_already_on_is_not_an_error(monkeypatch):
    _fake_gpus(monkeypatch, 3, initialised=True, growth_already=True)
    assert devices.configure_gpu_memory_growth() == 3


def test_memory_growth_without_gpus_does_nothing():
    assert devices.configure_gpu_memory_growth() == 0
    strategy = tfdp.make_strategy(cpu_replicas=2, memory_growth=True)
    assert strategy.num_replicas_in_sync == 2


def test_memory_growth_must_be_a_bool():
    with pytest.raises(TypeError, match="`memory_growth` must be True or False. "
                                        "Received: memory_growth='yes'"):
        strategy_lib.plan_strategy(num_gpus=0, memory_growth="yes")


# --- the GPUs a worker sees ----------------------------------------------------------

def test_strategy_info_shows_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    info = tfdp.strategy_info(tfdp.make_strategy("default"))
    assert info.visible_gpus == ("3", "5")
    assert info.describe().endswith("; visible GPUs 3,5 (CUDA_VISIBLE_DEVICES)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    info = tfdp.strategy_info(tfdp.make_strategy("default"))
    assert info.visible_gpus == ()
    assert info.describe().endswith("; visible GPUs none (CUDA_VISIBLE_DEVICES)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    info = tfdp.strategy_info(tfdp.make_strategy("default"))
    assert info.visible_gpus is None
    assert "visible GPUs" not in info.describe()


def test_visible_gpus_reads_the_variable_as_cuda_does():
    assert visible_gpus.visible_gpus({}) is None
    assert visible_gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-ab12, 7"}) == ("GPU-ab12", "7")
    assert visible_gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,x,3"}) == ("2",)


@pytest.mark.slow
def test_each_launched_worker_sees_and_logs_its_own_gpus(tmp_path):
    # CPU-only TensorFlow ignores CUDA_VISIBLE_DEVICES; what is checked is what each
    # worker was given and what its strategy reports.
    result = run_worker_script(tmp_path, """
        import tfdp
        strategy = tfdp.make_strategy("multi_worker")
        info = tfdp.strategy_info(strategy)
        print("visible", ",".join(info.visible_gpus))
        print("line", info.describe())
    """, nproc=2, timeout=180, env={"CUDA_VISIBLE_DEVICES": "3,5,6,7"}, check=True)
    assert result.worker_stdout(0)[0] == "visible 3,5"
    assert result.worker_stdout(1)[0] == "visible 6,7"
    assert result.worker_stdout(0)[1].endswith("; visible GPUs 3,5 (CUDA_VISIBLE_DEVICES)")
    assert ("GPUs per worker (CUDA_VISIBLE_DEVICES; of CUDA_VISIBLE_DEVICES=3,5,6,7): "
            "[0] 3,5 [1] 6,7") in result.launcher_messages()


def test_tfdp_train_gpu_memory_growth_reaches_the_strategy(monkeypatch):
    from tfdp.app import experiment, run_config, train

    assert train.FLAGS["gpu_memory_growth"].default is False
    seen = {}

    def plan_from_environment(kind, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped before any strategy is built")

    monkeypatch.setattr(experiment.strategy_lib, "plan_from_environment", plan_from_environment)
    with pytest.raises(run_config.ConfigError, match="stopped before"):
        experiment.train_and_evaluate(run_config.RunConfig(gpu_memory_growth=True),
                                      build_dataset=None, build_model=None)
    assert seen["memory_growth"] is True


def test_gpus_named_but_not_seen_by_tensorflow_are_warned_about(monkeypatch):
    # CPU-only TensorFlow (this machine) with GPUs assigned by the launcher.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    (warning,) = strategy_lib.plan_from_environment().warnings
    assert warning.startswith("CUDA_VISIBLE_DEVICES names 2 GPU(s) (3,5) but TensorFlow sees "
                              "0, so this process trains on the CPU.")
    _fake_gpus(monkeypatch, 2)
    assert strategy_lib.plan_from_environment().warnings == ()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose: nothing to say
    _fake_gpus(monkeypatch, 0)
    assert strategy_lib.plan_from_environment().warnings == ()
