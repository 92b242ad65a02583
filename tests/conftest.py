"""Shared pytest set-up for tfdp.

Tiers: `python -m pytest` (CI) runs every test; `python -m pytest -m "not
slow"` is the developer tier, which leaves out every test marked `slow`: those
that start worker processes and those that took a second or more on a 2-core
machine (the slowest case of a parametrised test decides for all of its cases).

The test process splits its CPU into ``TEST_CPU_DEVICES`` logical devices once,
before anything initialises TensorFlow, so every multi-replica path
(`tfdp.make_strategy(cpu_replicas=N)` for N <= 4) runs in-process without GPUs.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

TEST_CPU_DEVICES = 4

import tfdp  # noqa: E402

tfdp.configure_cpu_devices(TEST_CPU_DEVICES)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Give every test a clean Keras name scope and a fixed seed.

    `free_memory=False` skips Keras' `gc.collect()` (0.3 s a call with
    TensorFlow loaded); each test's objects are unreachable anyway.
    """
    import keras

    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(1234)
    yield
