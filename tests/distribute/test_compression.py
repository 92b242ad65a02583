"""PowerSGD and Top-K against NumPy implementations of the papers' algorithms.

Fixed per-replica gradient shares for several steps go through each
compressor on 2 logical CPU replicas (a MirroredStrategy that counts its
collectives and the values they carry); the estimates and the error
memories must equal NumPy simulations written from the papers (PowerSGD:
Vogels et al. 2019, Algorithms 1 and 2, in their mean convention with
Gram-Schmidt; Top-K with memory: Stich et al. 2018) to 1e-5, the collectives
must be the ones the docstrings promise, and a compressor that keeps
everything (rank ≥ the matrix dimensions, fraction 1) must equal the plain sum.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tfdp.distribute import compression
from tfdp.distribute.powersgd import PowerSGD
from tfdp.distribute.topk import TopK
import strategy_testing

REPLICAS = 2
STEPS = 4
# A conv kernel (18×8), a dense kernel (20×12), a bias, a small matrix that
# rank 4 does not pay for (3×2).
SHAPES = [(3, 3, 2, 8), (20, 12), (12,), (3, 2)]
TOLERANCE = 1e-5


def measuring_strategy():
    return strategy_testing.measuring_strategy(REPLICAS)


def shares(seed=11):
    """`[step][replica][variable]` float32 gradient shares."""
    rng = np.random.default_rng(seed)
    return [[[rng.normal(size=s).astype("float32") for s in SHAPES] for _ in range(REPLICAS)]
            for _ in range(STEPS)]


def run_compressor(compressor, per_step, all_reduce_dtype=None):
    """Each step's estimates (replica 0's, and whether every replica got the same) and the counters.

    The counters include `"dtypes"`: the dtypes of the floating-point tensors
    the collectives carried.
    """
    strategy, (calls, values, gathers) = measuring_strategy()
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
        compressor.build(variables)
    initial_state = [v.read_value().numpy() for v in compressor.state]
    outputs = []
    for step in per_step:
        # None: the variable has no gradient this step (on every replica).
        stacked = [None if step[0][i] is None else tf.constant(np.stack([r[i] for r in step]))
                   for i in range(len(SHAPES))]

        @tf.function
        def replica_fn():
            context = tf.distribute.get_replica_context()
            index = context.replica_id_in_sync_group
            sums, new_state = compressor.reduce(
                context, [None if s is None else s[index] for s in stacked], all_reduce_dtype)
            compressor.commit(new_state, tf.constant(True))
            return [s for s in sums if s is not None]

        local = iter([strategy.experimental_local_results(s) for s in strategy.run(replica_fn)])
        out = [None if s is None else next(local) for s in stacked]
        for per_replica in (o for o in out if o is not None):
            for other in per_replica[1:]:
                np.testing.assert_array_equal(other.numpy(), per_replica[0].numpy())
        outputs.append([None if o is None else o[0].numpy() for o in out])
    counts = {"all_reduces": int(calls.numpy()), "all_gathers": int(gathers.numpy()),
              "values": int(values.numpy()),
              "dtypes": {d for d in strategy.wire_dtypes if d.startswith(("float", "bfloat"))}}
    return outputs, initial_state, counts


def gram_schmidt(p):
    """The paper's orthogonalisation, column by column."""
    p = p.astype("float64").copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i])
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
    return p


def numpy_powersgd(per_step, initial_qs, plan, with_qs=False):
    """Algorithm 2 with Algorithm 1, as published: workers' gradients are R × their shares, means."""
    memories = {i: [np.zeros((e[0], e[1])) for _ in range(REPLICAS)]
                for i, e in enumerate(plan) if e is not None}
    qs = dict(zip([i for i, e in enumerate(plan) if e is not None], initial_qs))
    outputs = []
    for step in per_step:
        out = []
        for i, entry in enumerate(plan):
            if step[0][i] is None:  # no gradient: nothing sent, memory and Q kept
                out.append(None)
                continue
            grads = [REPLICAS * replica[i].astype("float64") for replica in step]
            if entry is None:
                out.append(np.mean(grads, axis=0))
                continue
            n, m, _ = entry
            local = [g.reshape(n, m) + e for g, e in zip(grads, memories[i])]
            p = np.mean([mat @ qs[i] for mat in local], axis=0)
            p_hat = gram_schmidt(p)
            q = np.mean([mat.T @ p_hat for mat in local], axis=0)
            approx = p_hat @ q.T
            memories[i] = [mat - approx for mat in local]
            qs[i] = q
            out.append(approx.reshape(SHAPES[i]))
        outputs.append(out)
    return (outputs, memories, qs) if with_qs else (outputs, memories)


def numpy_topk(per_step, fraction, sent_dtype=None):
    """Top-K with memory; with `sent_dtype` ("bfloat16") the sent values are rounded to it."""
    size = sum(math.prod(s) for s in SHAPES)
    k = max(1, math.ceil(fraction * size))
    work = "float64" if sent_dtype is None else "float32"  # round what tfdp rounds
    memories = [np.zeros(size, work) for _ in range(REPLICAS)]
    outputs = []
    for step in per_step:
        total = np.zeros(size)
        for r, replica in enumerate(step):
            acc = np.concatenate([g.ravel() for g in replica]).astype(work) + memories[r]
            keep = np.argsort(-np.abs(acc))[:k]
            sent = np.zeros(size, work)
            sent[keep] = acc[keep] if sent_dtype is None else (
                acc[keep].astype(ml_dtypes.bfloat16).astype(work))
            memories[r] = acc - sent
            total += sent
        outputs.append(np.split(total, np.cumsum([math.prod(s) for s in SHAPES])[:-1]))
    return outputs, memories


def assert_close(actual, expected):
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.reshape(actual, np.shape(expected)), expected,
                               rtol=TOLERANCE, atol=TOLERANCE * scale)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_equals_the_papers_algorithm_over_several_steps(rank):
    compressor = PowerSGD(rank=rank)
    per_step = shares()
    outputs, initial_state, counts = run_compressor(compressor, per_step)
    plan = compressor.plan(SHAPES)
    assert [e is not None for e in plan] == [True, True, False, False]
    compressed = sum(e is not None for e in plan)
    initial_qs = initial_state[compressed:]
    expected, memories = numpy_powersgd(per_step, initial_qs, plan)
    for got, want in zip(outputs, expected):
        for g, w in zip(got, want):
            assert_close(g, w)
    # Error memories: tfdp keeps the paper's divided by the replicas (sums, not means).
    state = [np.array(v.values[0]) if hasattr(v, "values") else v.numpy() for v in compressor.state]
    for got, index in zip(state, [i for i, e in enumerate(plan) if e is not None]):
        assert_close(got, memories[index][0] / REPLICAS)
    # Two collectives per step: P with the uncompressed tensors, then Q.
    assert counts["all_reduces"] == 2 * STEPS and counts["all_gathers"] == 0
    per_step_values = (18 + 8) * rank + (20 + 12) * rank + 12 + 6
    assert counts["values"] == per_step_values * STEPS
    assert compressor.values_sent([tf.zeros(s) for s in SHAPES]) == per_step_values


def test_powersgd_leaves_the_state_of_a_variable_without_a_gradient_untouched():
    """Steps 3-4 give the conv kernel and the bias no gradient: nothing of theirs is sent,
    their memory and Q stay as step 2 left them, and the others follow the paper."""
    compressor = PowerSGD(rank=1)
    per_step = shares()
    for step in per_step[2:]:
        for replica in step:
            replica[0] = replica[2] = None
    outputs, initial_state, counts = run_compressor(compressor, per_step)
    plan = compressor.plan(SHAPES)
    expected, memories, qs = numpy_powersgd(per_step, initial_state[2:], plan, with_qs=True)
    for got, want in zip(outputs, expected):
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if w is not None:
                assert_close(g, w)
    state = [np.array(v.values[0]) for v in compressor.state]
    for got, index in zip(state[:2], (0, 1)):
        assert_close(got, memories[index][0] / REPLICAS)
    for got, index in zip(state[2:], (0, 1)):  # Q: the paper's, up to QR's column signs
        assert_close(got * np.sign(np.sum(got * qs[index], axis=0)), qs[index])
    assert counts["values"] == 2 * ((18 + 8) + (20 + 12) + 12 + 6) + 2 * ((20 + 12) + 6)


@pytest.mark.slow
def test_powersgd_at_full_rank_equals_the_plain_sum():
    """Rank ≥ min(n, m) and compression forced on: P̂ spans the gradients, nothing is lost."""
    compressor = PowerSGD(rank=20, min_compression_ratio=0.01)
    assert all(e is not None for e in compressor.plan(SHAPES) if e)
    per_step = shares()
    outputs, _, _ = run_compressor(compressor, per_step)
    for got, step in zip(outputs, per_step):
        for g, i in zip(got, range(len(SHAPES))):
            assert_close(g, sum(replica[i].astype("float64") for replica in step))


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.05, 0.3])
def test_topk_equals_sparsified_sgd_with_memory(fraction):
    compressor = TopK(fraction=fraction)
    per_step = shares()
    outputs, _, counts = run_compressor(compressor, per_step)
    expected, memories = numpy_topk(per_step, fraction)
    for got, want in zip(outputs, expected):
        for g, w in zip(got, want):
            assert_close(g, w)
    state = compressor.state[0]
    local = [np.array(v) for v in state.values] if hasattr(state, "values") else [state.numpy()]
    for got, want in zip(local, memories):
        assert_close(got, want)
    size = sum(math.prod(s) for s in SHAPES)
    k = math.ceil(fraction * size)
    # One all-gather of k values and k int32 indices per step. The counting
    # ops see the values only: MirroredStrategy sends int32 tensors through
    # its own ReductionToOneDevice (mirrored_strategy._get_cross_device_ops).
    assert counts["all_reduces"] == 0 and counts["all_gathers"] == STEPS
    assert counts["values"] == k * STEPS
    assert compressor.values_sent([tf.zeros(s) for s in SHAPES]) == 2 * k


@pytest.mark.slow
def test_topk_in_bfloat16_sends_bfloat16_and_keeps_the_rounding_in_memory():
    """`all_reduce_dtype="bfloat16"` is used, not ignored: the sums are of bfloat16-rounded values.

    The values travel as int32 pairs of bfloat16 (CollectiveGatherV2 takes no
    bfloat16), which the measuring strategy does not count; the rounding is
    what shows.
    """
    compressor = TopK(fraction=0.3)
    per_step = shares()
    outputs, _, counts = run_compressor(compressor, per_step, "bfloat16")
    assert counts["dtypes"] == set()  # no float32 on the wire
    expected, memories = numpy_topk(per_step, 0.3, sent_dtype="bfloat16")
    for got, want in zip(outputs, expected):
        for g, w in zip(got, want):
            assert_close(g, w)
    # Not the float32 result: the rounding is real.
    float32_expected, _ = numpy_topk(per_step, 0.3)
    assert not np.allclose(outputs[-1][0].ravel(), float32_expected[-1][0], rtol=1e-5, atol=1e-5)
    local = [np.array(v) for v in compressor.state[0].values]
    for got, want in zip(local, memories):
        assert_close(got, want)


@pytest.mark.slow
def test_powersgd_in_bfloat16_sends_bfloat16_and_loses_nothing_for_good():
    """Both collectives carry bfloat16; what the estimate leaves out is in the memories."""
    compressor = PowerSGD(rank=2)
    per_step = shares()[:2]
    outputs, _, counts = run_compressor(compressor, per_step, "bfloat16")
    assert counts["dtypes"] == {"bfloat16"}
    assert counts["all_reduces"] == 2 * 2 and counts["all_gathers"] == 0
    # The kept Q factors are sums of bfloat16 values: representable in bfloat16.
    compressed = sum(e is not None for e in compressor.plan(SHAPES))
    for q in compressor.state[compressed:]:
        q = np.array(q.values[0])
        np.testing.assert_array_equal(q, q.astype(ml_dtypes.bfloat16).astype("float32"))
    float32_outputs, _, _ = run_compressor(PowerSGD(rank=2), per_step)
    assert not np.allclose(outputs[0][1], float32_outputs[0][1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs[0][1], float32_outputs[0][1], rtol=0.05, atol=0.05)
    # Error feedback over both steps: Σ shares = Σ estimates + Σ final memories.
    plan = compressor.plan(SHAPES)
    for memory, index in zip(compressor.state[:compressed],
                             [i for i, e in enumerate(plan) if e is not None]):
        n, m, _ = plan[index]
        sent = sum(replica[index].reshape(n, m).astype("float64")
                   for step in per_step for replica in step)
        kept = sum(np.array(v) for v in memory.values)
        got = sum(out[index].reshape(n, m) for out in outputs)
        assert_close(got + kept, sent)


def test_topk_with_everything_kept_equals_the_plain_sum():
    per_step = shares()
    outputs, _, _ = run_compressor(TopK(fraction=1.0), per_step)
    for got, step in zip(outputs, per_step):
        for g, i in zip(got, range(len(SHAPES))):
            assert_close(g, sum(replica[i].astype("float64") for replica in step))


def test_a_non_finite_value_reaches_every_replica_through_topk():
    """A NaN a replica would not send must still reach the sum, or the replicas' decisions differ."""
    per_step = shares()[:1]
    per_step[0][1][2][3] = np.nan  # replica 1's bias, small otherwise
    outputs, _, _ = run_compressor(TopK(fraction=0.01), per_step)
    assert np.isnan(outputs[0][2][3])


def test_an_uncommitted_step_leaves_the_state_unchanged():
    strategy, _ = measuring_strategy()
    compressor = TopK(fraction=0.1)
    with strategy.scope():
        compressor.build([tf.Variable(tf.zeros(s)) for s in SHAPES])
    step = shares()[0]
    stacked = [tf.constant(np.stack([replica[i] for replica in step])) for i in range(len(SHAPES))]

    @tf.function
    def replica_fn(applied):
        context = tf.distribute.get_replica_context()
        _, new_state = compressor.reduce(context, [s[context.replica_id_in_sync_group] for s in stacked])
        compressor.commit(new_state, applied)

    strategy.run(replica_fn, args=(tf.constant(False),))
    assert not np.any([np.array(v) for v in compressor.state[0].values])
    strategy.run(replica_fn, args=(tf.constant(True),))
    assert np.any([np.array(v) for v in compressor.state[0].values])


@pytest.mark.parametrize("make, message", [
    (lambda: PowerSGD(rank=0), "`rank` must be an integer ≥ 1. Received: rank=0"),
    (lambda: PowerSGD(rank=2.5), "`rank` must be an integer ≥ 1"),
    (lambda: PowerSGD(start_step=-1), "`start_step` must be an integer ≥ 0"),
    (lambda: PowerSGD(min_compression_ratio=0), "`min_compression_ratio` must be a number > 0"),
    (lambda: TopK(fraction=0), r"`fraction` must be a number in \(0, 1\]. Received: fraction=0"),
    (lambda: TopK(fraction=1.5), r"`fraction` must be a number in \(0, 1\]"),
    (lambda: compression.check("powersgd"), "PowerSGD"),
])
def test_bad_arguments_are_refused_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()
