"""Every training option alone and every pair of them: it trains, or it is refused up front.

The options are `tfdp.compile`'s (and `tfdp.Trainer`'s) gradient-path
options (float8 and overlapped local SGD included), plus the LARS and LAMB optimizers, the
mixed_float16 policy and `jit_compile`. Each case trains a tiny Dense model for one epoch of
`STEPS` steps on `make_strategy(cpu_replicas=2)`, or must be refused
before anything is built, by `tfdp.compile` and by `tfdp.Trainer`, with a
ValueError that names both options (`tfdp.training.option_rules`).

Where a reference exists the trained weights must equal it to 1e-5: the
options marked `EXACT` (accumulation, steps per execution, full-rank
PowerSGD, Top-K of everything, `outer_optimizer=SGD(1.0)` with
`sync_every=1` under SGD, ZeRO-1, the all-reduce in buckets) must not change the result, so a case equals the
same case without them. Under the 16-bit options the reference is held to
that format's rounding instead. `all_reduce_dtype="bfloat16"` must change
the result of every case it joins (an ignored dtype counts as broken).

Pairs that cannot be written down are left out: PowerSGD, Top-K and float8
are all values of `gradient_compression`, LARS and LAMB both optimizers,
and `overlap_sync` is itself `sync_every=2` overlapped.
`jit_compile=True` is refused by this strategy itself (XLA on several CPU
devices, `tfdp.distribute.devices`), so its cases check that refusal.
"""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training.batch import BatchConfig

GLOBAL_BATCH = 16
STEPS = 4
FEATURES = 8

_rng = np.random.default_rng(33)
X = _rng.normal(size=(GLOBAL_BATCH * STEPS, FEATURES)).astype("float32")
Y = _rng.integers(0, 4, GLOBAL_BATCH * STEPS)

#: Option name -> what it adds to a run: tfdp.compile keyword arguments,
#: or "optimizer" / "policy" entries.
OPTIONS = {
    "accum_steps": {"accum_steps": 2},
    "steps_per_execution": {"steps_per_execution": 2},
    "all_reduce_dtype": {"all_reduce_dtype": "bfloat16"},
    "PowerSGD": {"gradient_compression": lambda: tfdp.compression.PowerSGD(
        rank=FEATURES, min_compression_ratio=0.01)},
    "TopK": {"gradient_compression": lambda: tfdp.compression.TopK(fraction=1.0)},
    "float8": {"gradient_compression": "float8"},
    "sync_every": {"sync_every": 2},
    # Overlapped local SGD: the window's average arrives one window late.
    "overlap_sync": {"sync_every": 2, "overlap_sync": True},
    "outer_optimizer": {"outer_optimizer": lambda: keras.optimizers.SGD(1.0)},
    "shard_optimizer_state": {"shard_optimizer_state": True},
    "mixed_float16": {"policy": "mixed_float16"},
    "LAMB": {"optimizer": lambda: tfdp.optimizers.LAMB(0.01)},
    "LARS": {"optimizer": lambda: tfdp.optimizers.LARS(0.5, momentum=0.9, eeta=0.1)},
    "jit_compile": {"jit_compile": True},
    # Every variable its own bucket: the most all-reduces.
    "bucket_cap_mb": {"bucket_cap_mb": 1e-6},
}
#: Options that must leave the weights as they are without them (see the docstring).
EXACT = {"accum_steps", "steps_per_execution", "PowerSGD", "TopK", "outer_optimizer",
         "shard_optimizer_state", "bucket_cap_mb"}


def exact_options(case) -> set:
    """The options of `case` that must not change its result.

    An outer SGD(1.0) sets the weights to the replicas' average: with
    sync_every=1 that is synchronous training for SGD with momentum (linear
    in the gradients), not for LAMB or LARS, whose steps are not.
    """
    exact = EXACT & set(case)
    if {"LAMB", "LARS"} & set(case):
        exact.discard("outer_optimizer")
    return exact


#: The 16-bit options, and the tolerance a reference is held to under them.
ROUNDED = {"all_reduce_dtype": 2e-3, "mixed_float16": 2e-3}
#: Pairs of one argument's values.
INEXPRESSIBLE = {frozenset({"PowerSGD", "TopK"}), frozenset({"PowerSGD", "float8"}),
                 frozenset({"TopK", "float8"}), frozenset({"LAMB", "LARS"}),
                 frozenset({"sync_every", "overlap_sync"})}

_LOCAL = ("sync_every", "outer_optimizer", "overlap_sync")
#: The name a refusal of a local option gives it (overlap_sync is local SGD's window).
_LOCAL_NAME = {"overlap_sync": "sync_every"}
_GRADIENT_SUM = ("all_reduce_dtype", "PowerSGD", "TopK", "float8")
#: Refused pairs -> the names the error must contain.
REFUSED = {
    **{frozenset({local, other}): (_LOCAL_NAME.get(local, local), other)
       for local in _LOCAL for other in _GRADIENT_SUM + ("shard_optimizer_state",)},
    # float8 sends its own 8-bit values: a dtype for them would be ignored.
    frozenset({"float8", "all_reduce_dtype"}): ("float8", "all_reduce_dtype"),
    # The buckets cut the plain all-reduce, which these replace.
    **{frozenset({"bucket_cap_mb", other}): ("bucket_cap_mb", _LOCAL_NAME.get(other, other))
       for other in _LOCAL + ("PowerSGD", "TopK", "float8", "shard_optimizer_state")},
}
#: Refused by the strategy (XLA on several CPU devices), whatever joins it.
STRATEGY_REFUSED = "jit_compile"

SINGLES = [(name,) for name in OPTIONS]
PAIRS = [pair for pair in itertools.combinations(OPTIONS, 2)
         if frozenset(pair) not in INEXPRESSIBLE]
CASES = SINGLES + PAIRS


def outcome(case) -> tuple:
    """`("refused", names the error must hold)` or `("trains",)` for a case."""
    if STRATEGY_REFUSED in case:
        return ("refused", (STRATEGY_REFUSED,))
    if frozenset(case) in REFUSED:
        return ("refused", REFUSED[frozenset(case)])
    return ("trains",)


TRAINED = [case for case in CASES if outcome(case)[0] == "trains"]
REFUSED_CASES = [case for case in CASES if outcome(case)[0] == "refused"]


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH, drop_remainder=True)


def model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(FEATURES, activation="tanh"),
        keras.layers.Dense(4),
    ])


#: Options outside the matrix that some tests add.
EXTRA_OPTIONS = {"nonfinite=None": {"nonfinite": None}}


def arguments(case) -> dict:
    """The case's options merged into one dict; values built fresh."""
    merged = {"optimizer": lambda: keras.optimizers.SGD(0.1, momentum=0.9)}
    for name in case:
        merged.update(OPTIONS[name] if name in OPTIONS else EXTRA_OPTIONS[name])
    if {"sync_every", "overlap_sync"} & set(case) and "outer_optimizer" in case:
        merged["sync_every"] = 2
    return {key: value() if callable(value) else value for key, value in merged.items()}


class _Policy:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.previous = keras.config.dtype_policy().name
        keras.config.set_dtype_policy(self.name)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.previous)


def compile_case(strategy, case, built=None) -> keras.Model:
    """The case's model, compiled (`built`: a list that receives the model first)."""
    with strategy.scope():
        kwargs = arguments(case)
    with _Policy(kwargs.pop("policy", "float32")), strategy.scope():
        m = model()
        if built is not None:
            built.append(m)
        tfdp.compile(m, optimizer=kwargs.pop("optimizer"),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return m


def trainer_case(strategy, case) -> tfdp.Trainer:
    with strategy.scope():
        kwargs = arguments(case)
    batch = BatchConfig.from_global(GLOBAL_BATCH, 2, accum_steps=kwargs.pop("accum_steps", 1))
    kwargs["steps_per_loop"] = kwargs.pop("steps_per_execution", 1)
    with _Policy(kwargs.pop("policy", "float32")):
        with strategy.scope():
            m = model()
        return tfdp.Trainer(m, optimizer=kwargs.pop("optimizer"), strategy=strategy, batch=batch,
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            **kwargs)


_trained: dict = {}


def trained(strategy, case) -> tuple:
    """`(initial weights, final weights, losses)` of a case, fitted once per module."""
    key = frozenset(case)
    if key not in _trained:
        m = compile_case(strategy, case)
        initial = m.get_weights()
        losses = m.fit(dataset(), epochs=1, verbose=0).history["loss"]
        _trained[key] = (initial, m.get_weights(), losses)
    return _trained[key]


def assert_close(actual, expected, tolerance):
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINED, ids="+".join)
def test_trains_and_equals_its_reference(case, two_replicas):
    initial, weights, losses = trained(two_replicas, case)
    assert all(np.isfinite(loss) for loss in losses)
    assert not np.allclose(initial[0], weights[0]), "the weights did not move"
    exact = exact_options(case)
    if exact:
        reference = tuple(name for name in case if name not in exact)
        tolerance = max([1e-5] + [ROUNDED[name] for name in reference if name in ROUNDED])
        assert_close(weights, trained(two_replicas, reference)[1], tolerance)
    if "all_reduce_dtype" in case:
        full = tuple(name for name in case if name != "all_reduce_dtype")
        if outcome(full)[0] == "trains":
            _, float32_weights, _ = trained(two_replicas, full)
            # Used, not ignored: the bfloat16 sums move the weights away
            # from float32's, by about bfloat16's rounding.
            assert not all(np.array_equal(a, b) for a, b in zip(weights, float32_weights)), (
                f"{case}: all_reduce_dtype='bfloat16' changed nothing")
            assert_close(weights, float32_weights, ROUNDED["all_reduce_dtype"])


@pytest.mark.parametrize("case", REFUSED_CASES, ids="+".join)
@pytest.mark.parametrize("entry", ["compile", "trainer"])
def test_is_refused_before_anything_runs_naming_both_options(case, entry, two_replicas):
    built = []
    with pytest.raises(ValueError) as error:
        if entry == "compile":
            compile_case(two_replicas, case, built)
        else:
            trainer_case(two_replicas, case)
    for name in outcome(case)[1]:
        assert name in str(error.value), f"{name!r} not in: {error.value}"
    if STRATEGY_REFUSED not in case:
        assert "Use " in str(error.value), error.value
    if built:  # nothing was compiled: no optimizer, no train function
        assert getattr(built[0], "optimizer", None) is None
        assert getattr(built[0], "train_function", None) is None


@pytest.mark.parametrize("name", ["all_reduce_dtype", "PowerSGD", "TopK", "float8", "sync_every",
                                  "outer_optimizer", "shard_optimizer_state", "bucket_cap_mb"])
@pytest.mark.parametrize("entry", ["compile", "trainer"])
def test_without_the_wrapper_an_option_that_needs_it_is_refused(name, entry, two_replicas):
    """`nonfinite=None` turns tfdp's optimizer wrapper off; these options run inside it."""
    build = compile_case if entry == "compile" else trainer_case
    with pytest.raises(ValueError, match="nonfinite=None cannot be combined with") as error:
        build(two_replicas, (name, "nonfinite=None"))
    assert name in str(error.value) and "Use nonfinite='skip'" in str(error.value)


def test_the_matrix_covers_every_option_and_pair():
    assert len(SINGLES) == len(OPTIONS) == 15
    assert len(PAIRS) == 15 * 14 // 2 - len(INEXPRESSIBLE)
    assert {"LARS", "jit_compile", "float8", "overlap_sync", "bucket_cap_mb"} <= set(OPTIONS)
