"""The share planner of balanced per-worker batches, against brute force and a stand-in speed plan."""

import itertools

import numpy as np
import pytest

from tfdp.training import batch_shares


def _brute_force(global_batch, costs, minimum_share, fixed=None):
    """The smallest max_w(a_w + s_w * b_w) over every integer split, and a split reaching it."""
    costs = np.asarray(costs, float)
    fixed = np.zeros_like(costs) if fixed is None else np.asarray(fixed, float)
    best, best_split = float("inf"), None
    n = len(costs)
    for head in itertools.product(range(minimum_share, global_batch + 1), repeat=n - 1):
        last = global_batch - sum(head)
        if last < minimum_share:
            continue
        split = np.array((*head, last))
        makespan = float(np.max(fixed + split * costs))
        if makespan < best:
            best, best_split = makespan, tuple(int(s) for s in split)
    return best, best_split


@pytest.mark.parametrize("global_batch,costs,fixed,minimum_share", [
    (16, [1.0, 2.0], None, 1), (17, [1.0, 1.0, 3.0], None, 1), (12, [0.3, 0.7, 0.5], None, 2),
    (9, [1.0, 10.0], None, 1), (9, [1.0, 100.0], None, 3), (20, [2.0, 2.0, 2.0, 1.0], None, 1),
    (16, [1.0, 2.0], [8.0, 16.0], 1), (16, [1.0, 1.0], [0.0, 9.0], 1),
    (17, [1.0, 1.5, 3.0], [20.0, 1.0, 5.0], 1), (12, [0.3, 0.7, 0.5], [4.0, 0.0, 2.5], 2),
    (9, [1.0, 1.0], [30.0, 0.0], 1),
])
def test_plan_is_a_partition_with_the_smallest_makespan(global_batch, costs, fixed,
                                                        minimum_share):
    plan = batch_shares.plan_shares(global_batch, costs, fixed_seconds=fixed,
                                    minimum_share=minimum_share)
    assert plan.global_batch == global_batch and min(plan.shares) >= minimum_share
    assert plan.step_seconds(costs, fixed) == pytest.approx(
        _brute_force(global_batch, costs, minimum_share, fixed)[0])
    # The slices tile the global batch in worker order, each example once.
    covered = [i for w in range(plan.num_workers) for i in range(*plan.slice_of(w))]
    assert covered == list(range(global_batch))


def test_half_speed_worker_gets_a_third_and_equal_speeds_the_equal_split():
    assert batch_shares.plan_shares(64, [0.01, 0.02]).shares == (43, 21)
    # Its fixed cost doubled too (a throttled CPU), it gets less: 32 + s0 = 2 (32 + s1).
    assert batch_shares.plan_shares(64, [0.01, 0.02], fixed_seconds=[0.32, 0.64]).shares in {
        (53, 11), (54, 10)}
    for global_batch, workers in ((64, 2), (65, 2), (10, 4)):
        equal = batch_shares.equal_plan(global_batch, workers)
        assert batch_shares.plan_shares(global_batch, [0.5] * workers) == equal
        assert batch_shares.plan_shares(global_batch, [0.5] * workers,
                                        fixed_seconds=[9.0] * workers) == equal
    assert batch_shares.equal_plan(10, 4).shares == (3, 3, 2, 2)


@pytest.mark.parametrize("fixed_examples", [0.0, 5.0, 40.0])
def test_fit_matches_numpy_least_squares_on_affine_timings(fixed_examples):
    """Noise-free windows of a_w + b_w * s (a_w = f * b_w): the fit is NumPy's per-worker line."""
    b = np.array([0.001, 0.0023, 0.0017])
    shares = np.array([[22, 21, 21], [30, 10, 24], [26, 18, 20], [28, 14, 22]], float)
    seconds = fixed_examples * b + shares * b
    cost, found = batch_shares.fit_affine_costs(shares.tolist(), seconds.tolist(),
                                                [1.0] * len(shares), max_fixed_examples=512)
    assert found == pytest.approx(fixed_examples, rel=0.05, abs=0.02)
    for w in range(3):
        (a_ref, b_ref), *_ = np.linalg.lstsq(np.stack([np.ones(4), shares[:, w]], 1),
                                             seconds[:, w], rcond=None)
        assert cost.fixed_seconds[w] == pytest.approx(a_ref, rel=0.05, abs=1e-4)
        assert cost.seconds_per_example[w] == pytest.approx(b_ref, rel=0.05)
    # One share per worker cannot tell a from b: the given f (or 0) is used, and reported unfound.
    cost, found = batch_shares.fit_affine_costs(shares[:1].tolist(), seconds[:1].tolist(), [1.0],
                                                max_fixed_examples=512, fixed_examples=7.0)
    assert found is None
    np.testing.assert_allclose(np.array(cost.fixed_seconds) / cost.seconds_per_example, 7.0)
    np.testing.assert_allclose(cost.fixed_seconds + shares[0] * cost.seconds_per_example,
                               seconds[0])


def _simulate(planner, fixed, costs, windows, *, steps=20, noise=0.0, seed=0):
    """Windows of a stand-in speed plan: worker w's step takes a_w + b_w * s_w seconds.

    Each window's summed seconds get a multiplicative Gaussian noise of
    `noise` (relative). Returns `{window: shares}` of the plans adopted, and
    the true makespan of every window's plan.
    """
    rng = np.random.default_rng(seed)
    adopted, makespans = {}, []
    fixed, costs = np.asarray(fixed), np.asarray(costs)
    for window in range(1, windows + 1):
        shares = np.array(planner.plan.shares)
        makespans.append(float(np.max(fixed + costs * shares)))
        seconds = (fixed + costs * shares) * steps * (1 + noise * rng.standard_normal(len(shares)))
        planner.observe(seconds.tolist(), (shares * steps).tolist(), steps=steps)
        new = planner.maybe_replan(window)
        if new is not None:
            adopted[window] = new.shares
    return adopted, makespans


def test_equal_workers_with_a_large_fixed_cost_keep_or_regain_the_equal_split():
    """The drift case: a fixed cost per step as large as the share's compute."""
    fixed, costs = [0.032, 0.032], [0.001, 0.001]
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1)
    adopted, _ = _simulate(planner, fixed, costs, windows=50)
    assert adopted == {} and planner.plan.shares == (32, 32)
    # From an unequal start, the smaller share looks slower per example, so a
    # per-example model comes back only part of the way each planning ...
    start = (40, 24)
    per_example = [(a + b * s) / s for a, b, s in zip(fixed, costs, start)]
    assert batch_shares.plan_shares(64, per_example).shares == (36, 28)
    # ... the affine model finds the fixed cost as soon as a share changes, and comes back.
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1)
    planner.plan = batch_shares.SharePlan(start)
    adopted, _ = _simulate(planner, fixed, costs, windows=50)
    # Back within two plannings of the first one the planner may make.
    assert planner.plan.shares == (32, 32) and len(adopted) <= 3, adopted
    assert max(adopted) <= batch_shares.MIN_WINDOWS + 1, adopted
    assert planner.fixed_examples == pytest.approx(32, rel=0.05)


@pytest.mark.parametrize("fixed,costs", [
    ([0.032, 0.064], [0.001, 0.002]),  # throttled: fixed and per-example cost both doubled
    ([0.0, 0.0], [0.001, 0.002]),  # no fixed cost
    ([0.016, 0.016], [0.001, 0.002]),  # the fixed cost the same in seconds: a model misfit
    ([0.01, 0.01, 0.03], [0.001, 0.0015, 0.003]),
])
def test_a_slower_worker_gets_the_plan_of_the_smallest_makespan(fixed, costs):
    workers = len(costs)
    planner = batch_shares.SharePlanner(global_batch=16 * workers, num_workers=workers,
                                        replan_every=2)
    adopted, makespans = _simulate(planner, fixed, costs, windows=40)
    best, best_split = _brute_force(16 * workers, costs, 1, fixed)
    assert makespans[-1] <= 1.02 * best, (adopted, best_split)
    assert max(adopted) <= 10, adopted  # settled within a few plannings
    assert makespans[-1] < makespans[0]  # the equal split was not already the best


@pytest.mark.parametrize("seed", range(5))
def test_timing_noise_does_not_make_the_plan_wander(seed):
    """5% noise on every window's seconds, 200 windows."""
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1)
    adopted, _ = _simulate(planner, [0.032, 0.032], [0.001, 0.001], windows=200, noise=0.05,
                           seed=seed)
    assert len(adopted) <= 4, adopted
    assert all(abs(shares[0] - 32) <= 5 for shares in adopted.values()), adopted
    # With a straggler, noise leaves it near the smallest makespan, moving rarely.
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1)
    fixed, costs = [0.032, 0.064], [0.001, 0.002]
    adopted, makespans = _simulate(planner, fixed, costs, windows=200, noise=0.05, seed=seed)
    best, _ = _brute_force(64, costs, 1, fixed)
    assert len(adopted) <= 6, adopted
    # Within 10% of the best: the noise margin keeps a plan close to it.
    assert np.mean(makespans[100:]) <= 1.10 * best, adopted
    assert np.mean(makespans[100:]) <= makespans[0] / 1.3


def test_no_plan_before_min_windows_however_clear_the_first_timings():
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1)
    for window in range(1, batch_shares.MIN_WINDOWS):
        planner.observe([0.010, 0.040], [32, 32])  # worker 1 four times slower
        assert planner.maybe_replan(window) is None and planner.plan.shares == (32, 32)
    planner.observe([0.010, 0.040], [32, 32])
    assert planner.maybe_replan(batch_shares.MIN_WINDOWS).shares[1] < 16


def test_planner_ignores_small_gains_and_bad_timings():
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1,
                                        min_gain=0.05)
    planner.observe([0.0330, 0.0320], [32, 32])  # 3% apart: not worth moving examples
    assert planner.maybe_replan(1) is None and planner.plan.shares == (32, 32)
    planner.observe([float("nan"), 0.02], [32, 32])  # ignored whole
    planner.observe([0.0, 0.02], [32, 32])
    assert planner.seconds_per_example == pytest.approx([0.0330 / 32, 0.0320 / 32])
    assert planner.maybe_replan(0) is None  # nothing new to adopt
    fresh = batch_shares.SharePlanner(global_batch=64, num_workers=2)
    assert fresh.maybe_replan(20) is None  # no timings yet


@pytest.mark.parametrize("busy,whole,moves", [
    # 20% apart in the timed part, which is a fifth of a 20 ms step: moving
    # examples would win ~9% of the timed part, under 2% of the step.
    ((0.0048, 0.0040), 0.020, False),
    ((0.0048, 0.0040), None, True),  # the whole step unknown: the timed part is the step
    # A half-speed worker whose timed part is most of the step still moves.
    ((0.0080, 0.0040), 0.010, True),
    ((0.0080, 0.0040), float("nan"), True),  # a bad whole step is no whole step
])
def test_a_gain_is_weighed_against_the_whole_step(busy, whole, moves):
    """min_gain is of the synchronous step, the exchange included, not of the part the shares control."""
    planner = batch_shares.SharePlanner(global_batch=64, num_workers=2, replan_every=1)
    for window in range(1, batch_shares.MIN_WINDOWS + 3):
        planner.observe([20 * t for t in busy], [20 * 32, 20 * 32], steps=20,
                        whole_step_seconds=None if whole is None else 20 * whole)
        planner.maybe_replan(window)
    if moves:
        assert planner.plan.shares[0] < 32, planner.plan
    else:
        assert planner.plan.shares == (32, 32)
        expected = 0.05 * whole / busy[0]
        assert planner.required_gain() == pytest.approx(expected)
        assert planner.whole_step_seconds == pytest.approx(whole)


def test_the_whole_step_is_weighted_over_the_windows_as_the_fit():
    planner = batch_shares.SharePlanner(global_batch=8, num_workers=2, smoothing=0.5)
    planner.observe([1.0, 1.0], [4, 4], whole_step_seconds=None)
    assert planner.whole_step_seconds is None
    planner.observe([1.0, 1.0], [4, 4], whole_step_seconds=4.0)
    planner.observe([2.0, 2.0], [8, 8], steps=2, whole_step_seconds=4.0)  # 2 s per step
    # Weights 0.25, 0.5, 1 (newest); the first window gave no whole step.
    assert planner.whole_step_seconds == pytest.approx((0.5 * 4.0 + 1.0 * 2.0) / 1.5)


def test_every_worker_computes_the_same_plan_from_the_same_timings():
    timings = [([0.012, 0.031, 0.020], (22, 21, 21)), ([0.011, 0.033, 0.021], (22, 21, 21)),
               ([0.012, 0.032, 0.021], (22, 21, 21))]
    plans = []
    for _ in range(3):  # three workers, each its own planner
        planner = batch_shares.SharePlanner(global_batch=64, num_workers=3, replan_every=3)
        for step, (seconds, shares) in enumerate(timings, start=1):
            planner.observe(seconds, shares)
            planner.maybe_replan(step)
        plans.append(planner.plan)
    assert plans[0] == plans[1] == plans[2] and plans[0].shares[1] < 21


@pytest.mark.parametrize("call,match", [
    (lambda: batch_shares.plan_shares(3, [1.0, 1.0], minimum_share=2), "at least 4"),
    (lambda: batch_shares.plan_shares(8, [1.0, 0.0]), "positive, finite"),
    (lambda: batch_shares.plan_shares(8, []), "positive, finite"),
    (lambda: batch_shares.plan_shares(8, [1.0, 1.0], fixed_seconds=[-1.0, 0.0]),
     "fixed_seconds"),
    (lambda: batch_shares.plan_shares(8, [1.0, 1.0], fixed_seconds=[1.0]), "fixed_seconds"),
    (lambda: batch_shares.plan_shares(0, [1.0]), "global_batch"),
    (lambda: batch_shares.SharePlan((3, 0)), "positive integers"),
    (lambda: batch_shares.equal_plan(8, True), "num_workers"),
    (lambda: batch_shares.SharePlanner(global_batch=8, num_workers=2, replan_every=0),
     "replan_every"),
    (lambda: batch_shares.SharePlanner(global_batch=8, num_workers=2, smoothing=0),
     "smoothing"),
    (lambda: batch_shares.SharePlanner(global_batch=8, num_workers=2, min_gain=1.0),
     "min_gain"),
    (lambda: batch_shares.SharePlanner(global_batch=8, num_workers=2).observe([1.0], [8]),
     "one value per worker"),
    (lambda: batch_shares.SharePlanner(global_batch=8, num_workers=2, history=0), "history"),
    (lambda: batch_shares.SharePlan((4, 4)).slice_of(2), "worker"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()

