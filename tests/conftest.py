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


# --- stalls: long garbage collections, quick tests that hang -------------------
#
# CI saw tests that take a second take 70-120 s (a layout test inside
# `ast.parse`, an optimizer test), with the process nearly idle. One
# explanation: `_fresh_keras_state` skips Keras' `gc.collect()`, so garbage
# cycles holding TensorFlow objects of earlier tests pile up until a full
# collection, triggered by whatever test allocates next, runs their
# finalizers, and one of those waits. To tell:
# - every garbage collection of `_GC_REPORT_AFTER` seconds or more is
#   reported as a warning naming the test it ran in;
# - a test not marked `slow` (the developer tier: each took under a second)
#   that runs `_QUICK_TEST_STACKS_AFTER` seconds has every thread's stack
#   written out (faulthandler) into a warning.

import faulthandler  # noqa: E402
import gc  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

#: A collection at least this long (seconds) is reported.
_GC_REPORT_AFTER = 1.0
#: A test not marked `slow` still running after this many seconds has its threads' stacks dumped.
_QUICK_TEST_STACKS_AFTER = 30.0


def _warn_stall(item, message: str) -> None:
    # A built-in category: pytest-xdist re-creates a worker's warning in the
    # controller by importing its class, and a conftest's is not importable there.
    item.warn(UserWarning(f"stall: {message}"))


class _CollectionTimer:
    """A `gc.callbacks` entry that records every collection of `_GC_REPORT_AFTER` s or more."""

    def __init__(self):
        self.started = None
        self.stalls = []  # (seconds, generation, objects collected)

    def __call__(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            took, self.started = time.perf_counter() - self.started, None
            if took >= _GC_REPORT_AFTER:
                self.stalls.append((took, info["generation"], info["collected"]))


_COLLECTION_TIMER = _CollectionTimer()
gc.callbacks.append(_COLLECTION_TIMER)
_STACKS = tempfile.TemporaryFile(mode="w+")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Reports `item`'s long garbage collections, and its threads' stacks if a quick test hung."""
    del nextitem
    _COLLECTION_TIMER.stalls.clear()
    watched = item.get_closest_marker("slow") is None
    if watched:
        _STACKS.seek(0)
        _STACKS.truncate()
        faulthandler.dump_traceback_later(_QUICK_TEST_STACKS_AFTER, file=_STACKS)
    started = time.perf_counter()
    try:
        yield
    finally:
        if watched:
            faulthandler.cancel_dump_traceback_later()
    for took, generation, collected in _COLLECTION_TIMER.stalls:
        _warn_stall(item, f"a generation-{generation} garbage collection took {took:.1f} s "
                          f"({collected} objects collected) during {item.nodeid}")
    _COLLECTION_TIMER.stalls.clear()
    took = time.perf_counter() - started
    if watched and took >= _QUICK_TEST_STACKS_AFTER:
        _STACKS.seek(0)
        _warn_stall(item, f"{item.nodeid}, not marked slow, took {took:.0f} s; its threads "
                          f"after {_QUICK_TEST_STACKS_AFTER:g} s:\n{_STACKS.read()}")
