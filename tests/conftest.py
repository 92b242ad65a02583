"""Shared pytest set-up for tfdp.

Tiers: `python -m pytest -n auto` (CI) runs every test, in as many test
processes as there are CPUs (at most 4; pytest-xdist, one test file per
process at a time); `python -m pytest -n auto -m "not slow"` is the developer tier, which leaves out every test marked `slow`: those
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

#: At most this many test processes for `-n auto` (pytest-xdist).
MAX_TEST_PROCESSES = 4


#: The test files that took 100 s or more in a serial run on a 2-core Intel
#: Xeon (family 6 model 207, 2026-11-27), longest first. They are collected
#: first, so that with `-n auto` (one file per test process at a time) none
#: of them starts last while the other processes have nothing left to run:
#: longest first is the classic fix for a long tail. A file missing here
#: only runs in its usual place.
LONGEST_FILES = (
    "tests/bench/test_bench_suite.py",              # 283 s: the whole --smoke suite
    "tests/app/test_train_e2e.py",                  # 261 s
    "tests/training/test_multiworker_training.py",  # 180 s
    "tests/app/test_fault_soak.py",                 # 178 s
    "tests/app/test_predict_cli.py",                # 110 s
    "tests/slurm/test_slurm_jobs.py",               # 109 s
    "tests/training/test_loss_normalization.py",    # 103 s
)


def pytest_collection_modifyitems(config, items):
    """Moves the tests of `LONGEST_FILES` to the front, in that order (a stable sort)."""
    del config
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one test process per CPU this process may run on, at most `MAX_TEST_PROCESSES`.

    The suite's time is half start-up, tracing and waiting for worker
    processes, during which one test process leaves a 2-core machine's second
    core idle (busy 59% of a serial run, 2026-11-27): two test processes use it.
    More than four would mostly compete: every multi-worker test starts two or
    more TensorFlow processes of its own.
    """
    del config
    return max(1, min(len(os.sched_getaffinity(0)), MAX_TEST_PROCESSES))


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
