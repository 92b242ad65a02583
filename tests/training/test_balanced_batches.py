"""Balanced per-replica batches under `tfdp.compile(..., balance_batches=...)` (issue 35, item 2).

On `make_strategy(cpu_replicas=2)`, in process:

- a fixed unequal plan (11, 5 of 16) trains to one device's weights and
  logged loss on the whole global batch, and a split that is not a partition
  (the last example of each batch dropped) is told apart by the same
  comparison;
- with a real slowdown on replica 1 (a layer that burns compute per example
  there only), the re-planner moves examples to replica 0, and every example
  of every global batch is still computed exactly once (a layer counts the
  example ids each replica's forward pass sees);
- the timings add no all-reduce: one per step, the gradients', as without
  balancing;
- what cannot be combined with it is refused by name, before anything runs;
- on one replica it does nothing.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.training import balanced_batches
from tests.strategy_testing import counting_mirrored_strategy

GLOBAL_BATCH = 16
STEPS = 4
FEATURES = 8
LEARNING_RATE = 0.1
PLAN = (11, 5)

_rng = np.random.default_rng(35)
X = _rng.normal(size=(GLOBAL_BATCH * STEPS, FEATURES)).astype("float32")
Y = _rng.integers(0, 4, GLOBAL_BATCH * STEPS)


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def dataset(x=X, y=Y, batch=GLOBAL_BATCH):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def model(features=FEATURES):
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((features,)), keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(4),
    ])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def one_device():
    """Plain Keras on one device, on the whole global batches: `(weights, logged losses)`."""
    reference = model()
    reference.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), loss=loss())
    history = reference.fit(dataset(), epochs=2, verbose=0).history
    return reference.get_weights(), history["loss"]


def balanced_fit(strategy, balance, *, epochs=2, data=None, build=model, callbacks=(),
                 **compile_kwargs):
    with strategy.scope():
        m = build()
        tfdp.compile(m, optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9),
                     loss=loss(), balance_batches=balance, **compile_kwargs)
    history = m.fit(dataset() if data is None else data, epochs=epochs, verbose=0,
                    callbacks=list(callbacks)).history
    return m, history["loss"]


def max_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


@pytest.mark.slow
def test_fixed_unequal_plan_equals_one_device(two_replicas):
    """(11, 5) of every batch of 16: the weights and logged losses of one device, to 1e-5."""
    weights, losses = one_device()
    m, tfdp_losses = balanced_fit(
        two_replicas, balanced_batches.BalanceOptions(replan_every=None, shares=PLAN))
    assert max_difference(m.get_weights(), weights) < 1e-5
    np.testing.assert_allclose(tfdp_losses, losses, rtol=1e-5)
    balance = m.tfdp_balanced_batches
    assert tuple(balance.plan.numpy()) == PLAN
    # Each replica computed its share: the examples that rode in the all-reduce
    # since the first execution (dropped as warm-up).
    r, timed = 2, 2 * STEPS - 1
    examples = balance.totals.numpy()[r:2 * r]
    assert tuple(examples) == (PLAN[0] * timed, PLAN[1] * timed)
    assert balance.totals.numpy()[2 * r] == timed


def test_each_replica_times_its_whole_step_but_the_exchange(two_replicas):
    """Busy seconds run from the last all-reduce's return to the gradients, and ride summed.

    An execution's first step is timed from its slice (the host ran before
    it); every other step from the previous step's return, so it holds the
    compute and the optimizer update, input and loop between them.
    """
    m, _ = balanced_fit(two_replicas,
                        balanced_batches.BalanceOptions(replan_every=None, shares=PLAN),
                        steps_per_execution=2)
    balance = m.tfdp_balanced_batches
    executions = 2 * STEPS // 2 - 1  # the first execution's timings are dropped
    timed = 2 * executions
    spans = [v.numpy() for v in two_replicas.experimental_local_results(balance.spans)]
    for compute, busy, exchange, steps in spans:
        assert steps == timed
        assert busy >= compute > 0 and exchange > 0
    # What rode in the all-reduce is each replica's own busy seconds.
    np.testing.assert_allclose(balance.totals.numpy()[:2], [s[1] for s in spans], rtol=1e-5)
    # Each step after an execution's first carried the exchange before it.
    exchange_totals = balance.exchange_totals.numpy()
    assert exchange_totals[2] == timed - executions
    assert all(0 < exchange_totals[r] <= spans[r][2] for r in range(2))


class _ForcePlans(keras.callbacks.Callback):
    """Assigns a different plan after every step, as a re-planning would (the results must not move)."""

    PLANS = ((11, 5), (3, 13), (8, 8), (15, 1))

    def __init__(self, model):
        super().__init__()
        self._model = model
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        plan = self.PLANS[self.steps % len(self.PLANS)]
        self._model.tfdp_balanced_batches.plan.assign(plan)


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_plans_changing_between_steps_equal_one_device(two_replicas, steps_per_execution):
    """A new plan at every execution, 1 or 2 steps each: still one device's weights and losses."""
    weights, losses = one_device()
    with two_replicas.scope():
        m = model()
        tfdp.compile(m, optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), loss=loss(),
                     steps_per_execution=steps_per_execution,
                     balance_batches=balanced_batches.BalanceOptions(replan_every=None))
    forcing = _ForcePlans(m)
    history = m.fit(dataset(), epochs=2, verbose=0, callbacks=[forcing]).history
    assert forcing.steps == 2 * STEPS // steps_per_execution
    assert max_difference(m.get_weights(), weights) < 1e-5
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5)


def test_new_plans_are_not_retraced(two_replicas, monkeypatch):
    """A re-plan assigns the plan variable: the step is traced once, however often it changes."""
    traced = []
    cut = balanced_batches.BalancedBatches.replica_slice

    def counting(self, data):
        traced.append(tf.distribute.get_replica_context().replica_id_in_sync_group)
        return cut(self, data)

    monkeypatch.setattr(balanced_batches.BalancedBatches, "replica_slice", counting)
    with two_replicas.scope():
        m = model()
        tfdp.compile(m, optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), loss=loss(),
                     steps_per_execution=2,
                     balance_batches=balanced_batches.BalanceOptions(replan_every=None))
    forcing = _ForcePlans(m)
    m.fit(dataset(), epochs=2, verbose=0, callbacks=[forcing])
    assert forcing.steps == STEPS  # a new plan after each of the 4 executions
    assert len(traced) == 2, traced  # one trace, once per replica


@pytest.mark.slow
def test_a_split_that_is_no_partition_is_told_apart(two_replicas, monkeypatch):
    """Negative control: the last example of each batch left out is 1e-3 away from one device."""
    weights, losses = one_device()
    monkeypatch.setattr(balanced_batches, "slice_bounds",
                        lambda plan, examples: tf.constant([0, PLAN[0], GLOBAL_BATCH - 1],
                                                           tf.int64))
    m, _ = balanced_fit(
        two_replicas, balanced_batches.BalanceOptions(replan_every=None, shares=PLAN))
    assert max_difference(m.get_weights(), weights) > 1e-3


def test_slice_bounds_partition_every_batch_size():
    """The plan's shares exactly at its own sum; in proportion, still a partition, below it."""
    plan = tf.constant(PLAN, tf.int32)
    np.testing.assert_array_equal(balanced_batches.slice_bounds(plan, 16).numpy(), [0, 11, 16])
    for examples in range(0, 17):
        bounds = balanced_batches.slice_bounds(plan, examples).numpy()
        assert bounds[0] == 0 and bounds[-1] == examples
        assert np.all(np.diff(bounds) >= 0)


# --- the re-planner, on a real slowdown -----------------------------------------

SLOW_FEATURES = 256
SLOW_STEPS = 30


class SlowOnReplicaOne(keras.layers.Layer):
    """Passes its input on; on replica 1 only, first burns `rounds` wide matmuls per example.

    Each round is ~2 M multiply-adds per example (256 -> 4096 -> 256
    features), so the burn grows with the share, as a slower CPU's does: a
    burn of many small rounds would be mostly a fixed cost per step, which
    moving examples cannot shorten.
    """

    def __init__(self, rounds, **kwargs):
        super().__init__(**kwargs)
        self.rounds = rounds
        # Constants made once: filling them in every step would be a fixed cost.
        self.up = tf.constant(np.full([SLOW_FEATURES, 4096], 1 / SLOW_FEATURES, "float32"))
        self.down = tf.constant(np.full([4096, SLOW_FEATURES], 1 / 4096, "float32"))

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        context = tf.distribute.get_replica_context()
        if context is None or tf.get_static_value(context.replica_id_in_sync_group) != 1:
            return x
        h = tf.while_loop(lambda i, h: i < self.rounds,
                          lambda i, h: (i + 1, tf.tanh(tf.matmul(tf.matmul(h, self.up),
                                                                 self.down))),
                          (tf.constant(0), x))[1]
        return x + tf.stop_gradient(0.0 * tf.reduce_sum(h))


class SeenIds(keras.layers.Layer):
    """Counts, per example id (column 0 of the input), how often a forward pass saw it."""

    def __init__(self, num_ids, **kwargs):
        super().__init__(**kwargs)
        # Each replica adds to its own copy; read outside the step, the copies are summed.
        self.seen = tf.Variable(tf.zeros([num_ids]), trainable=False,
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.SUM)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        if tf.distribute.in_cross_replica_context():
            return x  # Keras' symbolic build, not a step
        ids = tf.cast(tf.round(x[:, 0]), tf.int32)
        self.seen.assign_add(tf.reduce_sum(tf.one_hot(ids, self.seen.shape[0]), axis=0))
        return x


def slow_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((SLOW_FEATURES,)), SeenIds(GLOBAL_BATCH * SLOW_STEPS),
        SlowOnReplicaOne(4), keras.layers.Dense(4),
    ])


def slow_data():
    """`(x, y)` for `slow_model`: feature 0 is each example's id (for `SeenIds`)."""
    rng = np.random.default_rng(1)
    n = GLOBAL_BATCH * SLOW_STEPS
    x = rng.normal(size=(n, SLOW_FEATURES)).astype("float32")
    x[:, 0] = np.arange(n)
    return x, rng.integers(0, 4, n)


@pytest.mark.slow
def test_replanner_moves_examples_to_the_faster_replica_and_keeps_a_partition(two_replicas):
    x, y = slow_data()
    n = len(x)
    m, _ = balanced_fit(two_replicas, balanced_batches.BalanceOptions(replan_every=5),
                        epochs=1, data=dataset(x, y), build=slow_model)
    balance = m.tfdp_balanced_batches
    assert balance.history, "the plan never moved"
    first_step, first_plan = balance.history[0]
    assert first_plan[0] > first_plan[1], balance.history
    final = tuple(int(s) for s in balance.plan.numpy())
    assert sum(final) == GLOBAL_BATCH and final[0] > GLOBAL_BATCH // 2, balance.history
    per_example = balance.planner.seconds_per_example
    assert per_example[1] > per_example[0]
    # Every example of every global batch was computed exactly once, through every plan.
    seen = m.layers[0].seen.numpy()
    np.testing.assert_array_equal(seen, np.ones(n))


@pytest.mark.slow
def test_timings_add_no_all_reduce():
    """One all-reduce per step, the gradients' (the seconds ride in it), as without balancing."""
    for balance in (False, balanced_batches.BalanceOptions(replan_every=2, shares=PLAN)):
        strategy, counter = counting_mirrored_strategy()
        balanced_fit(strategy, balance, epochs=1)
        assert int(counter.numpy()) == STEPS, balance


# --- refusals and the one-replica case -----------------------------------------

REFUSALS = [
    ({"accum_steps": 2},
     "balance_batches=True cannot be combined with accum_steps=2: a replica's share follows "
     "its speed, so it need not split into accum_steps equal micro-batches. Use accum_steps=1 "
     "with balance_batches (the shares are the memory knob: each replica computes only its "
     "own), or balance_batches=False to accumulate."),
    ({"sync_every": 4},
     "balance_batches=True cannot be combined with sync_every=4: local steps make no gradient "
     "all-reduce per step for the shares to complete or the timings to ride in. Use "
     "sync_every=1 and no outer_optimizer with balance_batches, or balance_batches=False for "
     "local steps."),
    ({"gradient_compression": "bfloat16"},
     "balance_batches=True cannot be combined with all_reduce_dtype='bfloat16' (or "
     "gradient_compression='bfloat16'): the replicas' compute seconds ride, exactly in "
     "float32, in the plain all-reduce of the gradients, which a compressed or 16-bit sum "
     "replaces. Use gradient_compression=None and all_reduce_dtype=None with "
     "balance_batches, or balance_batches=False to compress."),
    ({"gradient_compression": "powersgd"}, None),
    ({"shard_optimizer_state": True},
     "balance_batches=True cannot be combined with shard_optimizer_state=True: ZeRO-1 "
     "reduce-scatters the gradients, and the replicas' compute seconds ride only in the plain "
     "all-reduce. Use shard_optimizer_state=False with balance_batches, or "
     "balance_batches=False to shard the optimizer state."),
    ({"nonfinite": None},
     "balance_batches=True cannot be combined with nonfinite=None: the replicas' compute "
     "seconds ride in the gradient all-reduce of tfdp's optimizer wrapper, which comes with "
     "the non-finite step handling that nonfinite=None turns off. Use nonfinite='skip' (the "
     "default) or 'raise', or balance_batches=False."),
    ({"jit_compile": True},
     "balance_batches=True cannot be combined with jit_compile=True: each replica times its "
     "step with tf.timestamp, which XLA cannot compile. Use jit_compile=False with "
     "balance_batches, or balance_batches=False to compile with XLA."),
    ({"loss_normalization": "per_replica"},
     "balance_batches=True cannot be combined with loss_normalization='per_replica': each "
     "replica's own mean, averaged, weights the examples of a small share more than those of "
     "a large one, so the result would depend on the plan. Use loss_normalization='global' "
     "(the default) with balance_batches, or balance_batches=False."),
]


@pytest.mark.parametrize("options, message", REFUSALS,
                         ids=[next(iter(o)) + ("" if m else "_powersgd") for o, m in REFUSALS])
def test_refused_before_anything_is_built(two_replicas, options, message):
    if options.get("gradient_compression") == "powersgd":
        options = {"gradient_compression": tfdp.compression.PowerSGD(rank=2)}
    with two_replicas.scope():
        m = model()
    with pytest.raises(ValueError) as raised:
        tfdp.compile(m, optimizer="sgd", loss=loss(), balance_batches=True, **options)
    if message is None:
        assert str(raised.value).startswith("balance_batches=True cannot be combined with "
                                            "gradient_compression=PowerSGD(")
        assert "balance_batches=False to compress" in str(raised.value)
    else:
        assert str(raised.value) == message
    assert not m.compiled  # refused before model.compile


def test_fit_input_must_be_a_dataset(two_replicas):
    with two_replicas.scope():
        m = model()
        tfdp.compile(m, optimizer="sgd", loss=loss(), balance_batches=True)
    with pytest.raises(ValueError, match="With balance_batches, fit's `x` must be a "
                                         "tf.data.Dataset of global batches"):
        m.fit(X, Y, batch_size=GLOBAL_BATCH, verbose=0)


def test_bad_options():
    with pytest.raises(TypeError, match="`balance_batches` must be True, False or a"):
        balanced_batches.options_of("yes")
    with pytest.raises(ValueError, match="`shares` must be a non-empty sequence"):
        balanced_batches.BalanceOptions(shares=(3, 0))
    with pytest.raises(ValueError, match="`replan_every` must be a positive integer"):
        balanced_batches.BalanceOptions(replan_every=0)


@pytest.mark.slow
def test_does_nothing_on_one_replica():
    m = model()
    tfdp.compile(m, optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), loss=loss(),
                 balance_batches=True)
    assert m.tfdp_balanced_batches is None
    m.fit(X, Y, batch_size=GLOBAL_BATCH, verbose=0)  # arrays are fine: nothing is replicated


# --- tfdp.Trainer ----------------------------------------------------------------

def trainer(strategy, balance, **kwargs):
    with strategy.scope():
        m = model()
        return tfdp.Trainer(m, optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9),
                            loss=loss(), strategy=strategy,
                            batch=tfdp.BatchConfig.from_global(GLOBAL_BATCH, 2),
                            balance_batches=balance, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_loop", [1, 2])
def test_trainer_with_a_fixed_unequal_plan_equals_one_device(two_replicas, steps_per_loop):
    weights, losses = one_device()
    t = trainer(two_replicas, balanced_batches.BalanceOptions(replan_every=None, shares=PLAN),
                steps_per_loop=steps_per_loop)
    logs = t.train(dataset(), epochs=2)
    assert logs["steps"] == 2 * STEPS
    assert max_difference(t.model.get_weights(), weights) < 1e-5
    np.testing.assert_allclose(logs["loss"], losses[-1], rtol=1e-5)
    balance = t.balanced_batches
    timed = 2 * STEPS - steps_per_loop  # the first call's timings are dropped
    np.testing.assert_array_equal(balance.totals.numpy()[2:],
                                  [PLAN[0] * timed, PLAN[1] * timed, timed])


@pytest.mark.slow
def test_trainer_replans_on_a_real_slowdown(two_replicas):
    x, y = slow_data()
    n = len(x)
    with two_replicas.scope():
        m = slow_model()
        t = tfdp.Trainer(m, optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss(),
                         strategy=two_replicas, batch=tfdp.BatchConfig.from_global(GLOBAL_BATCH, 2),
                         balance_batches=balanced_batches.BalanceOptions(replan_every=5))
    t.train(dataset(x, y), epochs=1)
    balance = t.balanced_batches
    assert balance.history and balance.history[0][1][0] > balance.history[0][1][1], \
        balance.history
    np.testing.assert_array_equal(m.layers[0].seen.numpy(), np.ones(n))


def test_trainer_refuses_by_name(two_replicas):
    with two_replicas.scope():
        m = model()
        with pytest.raises(ValueError, match="^balance_batches=True cannot be combined with "
                                             "sync_every=2: "):
            tfdp.Trainer(m, optimizer=keras.optimizers.SGD(0.1), loss=loss(),
                         strategy=two_replicas, batch=tfdp.BatchConfig.from_global(16, 2),
                         balance_batches=True, sync_every=2)


@pytest.mark.slow
def test_mixed_float16_with_a_fixed_unequal_plan_is_one_device_to_float16(two_replicas):
    """The loss-scaling wrapper carries the timings too; the result is one device's, rounded."""
    weights, losses = one_device()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        m, tfdp_losses = balanced_fit(
            two_replicas, balanced_batches.BalanceOptions(replan_every=None, shares=PLAN))
    finally:
        keras.config.set_dtype_policy("float32")
    assert type(m.optimizer).__name__ == "NonFiniteLossScaleOptimizer"
    assert max_difference(m.get_weights(), weights) < 1e-3
    np.testing.assert_allclose(tfdp_losses, losses, rtol=1e-3)
    assert tuple(m.tfdp_balanced_batches.totals.numpy()[2:4]) == (PLAN[0] * 7, PLAN[1] * 7)


@pytest.mark.slow
def test_trainer_resumed_mid_epoch_equals_one_device(two_replicas, tmp_path):
    """Stopped after 3 steps and resumed (the plan starts over, the input skips 3 batches): one device."""
    weights, _ = one_device()
    options = balanced_batches.BalanceOptions(replan_every=None, shares=PLAN)
    first = trainer(two_replicas, options, model_dir=str(tmp_path))
    assert first.train(dataset(), steps=3)["steps"] == 3
    resumed = trainer(two_replicas, options, model_dir=str(tmp_path))
    logs = resumed.train(dataset(), epochs=2)
    assert logs["steps"] == 2 * STEPS
    assert max_difference(resumed.model.get_weights(), weights) < 1e-5


class _Interrupted(Exception):
    pass


class _InterruptAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.steps:
            raise _Interrupted()


@pytest.mark.slow
def test_fit_on_a_backup_wrapped_input_resumed_mid_epoch_equals_one_device(two_replicas,
                                                                           tmp_path):
    """fit(backup.wrap(...)) with balance_batches: stopped after 3 steps, resumed at batch 3
    of epoch 0 (each epoch a tf.data.Dataset, replicated whole): one device's weights."""
    from tfdp.callbacks import BackupAndRestore

    weights, _ = one_device()
    options = balanced_batches.BalanceOptions(replan_every=None, shares=PLAN)
    backup_dir = tmp_path / "backup"

    def run(callbacks):
        with two_replicas.scope():
            m = model()
            tfdp.compile(m, optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9),
                         loss=loss(), balance_batches=options)
        backup = BackupAndRestore(backup_dir, save_freq=1)
        m.fit(backup.wrap(lambda epoch: dataset()), epochs=2, verbose=0,
              callbacks=[backup, *callbacks])
        return m

    with pytest.raises(_Interrupted):
        run([_InterruptAfter(3)])
    resumed = run([])
    assert int(resumed.optimizer.iterations.numpy()) == 2 * STEPS
    assert max_difference(resumed.get_weights(), weights) < 1e-5
    # The resumed fit computed (11, 5) of each of its 5 batches after the warm-up execution.
    r = 2
    assert tuple(resumed.tfdp_balanced_batches.totals.numpy()[r:2 * r]) == (
        PLAN[0] * 4, PLAN[1] * 4)


def test_fit_refuses_a_backup_wrapped_input_of_distributed_epochs(two_replicas, tmp_path):
    from tfdp.callbacks import BackupAndRestore

    with two_replicas.scope():
        m = model()
        tfdp.compile(m, optimizer="sgd", loss=loss(), balance_batches=True)
    backup = BackupAndRestore(tmp_path / "backup")
    wrapped = backup.wrap(lambda epoch: two_replicas.experimental_distribute_dataset(dataset()))
    with pytest.raises(ValueError, match="each epoch of a BackupAndRestore.wrap"):
        m.fit(wrapped, epochs=1, verbose=0, callbacks=[backup])
