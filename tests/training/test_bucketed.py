"""The all-reduce in DDP's buckets during the backward pass (`tfdp.training.exchanges.bucketed`).

- The bucket assignment equals a plain transcription of DDP's rule
  (`_compute_bucket_assignment_by_size` over gradients in ready order, with
  the first bucket capped at 1 MiB), on random sizes, dtypes and sparse
  gradients.
- Each bucket's all-reduce depends on its own gradients only: in the traced
  step no collective has the gradient of a later bucket among its ancestors,
  so the executor may start it while the backward pass goes on.
- On 2 logical CPU replicas it trains every loss form to the plain
  all-reduce's weights (1e-6 of the update) and to one device's (1e-5, as
  the plain all-reduce is held), whatever the cap.
- Bad values are refused by name; `bucket_cap_mb` reaches the wrapper's
  config and back; one inter-op thread, with which nothing overlaps, is
  warned about.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import loss_forms
import tfdp
from loss_forms import FORMS, FORMS_BY_NAME, LEARNING_RATE
from tfdp.training import exchanges
from tfdp.training import nonfinite
from tfdp.training.exchanges import bucketed

MIB = 1 << 20


def reference_assignment(sizes, cap, first_cap):
    """DDP's rule, written out: a bucket per dtype, closed at its limit; sparse alone."""
    result, buckets, limits = [], {}, {}
    for index, (nbytes, dtype, sparse) in enumerate(sizes):
        if sparse:
            result.append(([index], dtype, nbytes))
            continue
        bucket = buckets.setdefault(dtype, [[], 0])
        bucket[0].append(index)
        bucket[1] += nbytes
        limit = limits.get(dtype, min(first_cap, cap))
        if bucket[1] >= limit:
            result.append((bucket[0], dtype, bucket[1]))
            del buckets[dtype]
            limits[dtype] = cap
    for dtype, (indices, nbytes) in sorted(buckets.items(), key=lambda kv: kv[1][0][0]):
        result.append((indices, dtype, nbytes))
    return result


@pytest.mark.parametrize("seed", range(20))
def test_the_assignment_is_ddps_rule(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    sizes = [(int(rng.choice([4, 400, 40_000, 600_000, 3 * MIB])),
              str(rng.choice(["float32", "float32", "float16"])), bool(rng.random() < 0.1))
             for _ in range(count)]
    cap = int(rng.choice([1, 100_000, MIB, 25 * MIB]))
    got = bucketed.bucket_assignment(sizes, cap)
    want = reference_assignment(sizes, cap, bucketed.FIRST_BUCKET_BYTES)
    assert [(list(b.indices), b.dtype, b.nbytes) for b in got] == want
    assert sorted(i for b in got for i in b.indices) == list(range(count))


def test_buckets_start_at_the_last_layer_and_the_first_is_small():
    exchange = bucketed.Bucketed(None, bucket_cap_mb=4)
    # Layer order: three 2 MiB kernels, then a 4-byte bias: ready in reverse.
    gradients = [tf.zeros([MIB // 2]), tf.zeros([MIB // 2]), tf.zeros([MIB // 2]), tf.zeros([1])]
    buckets = exchange.buckets(gradients)
    assert [b.indices for b in buckets] == [(3, 2), (1, 0)]
    assert [b.nbytes for b in buckets] == [4 + 2 * MIB, 4 * MIB]


@pytest.fixture(scope="module")
def two_replicas():
    return tfdp.make_strategy(cpu_replicas=2)


def _mlp():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(7, activation="tanh"),
                             keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])


def _ancestors(op, control=True):
    seen, stack = {op}, [op]
    while stack:
        current = stack.pop()
        parents = [t.op for t in current.inputs]
        for parent in parents + (list(current.control_inputs) if control else []):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def test_no_bucket_waits_for_a_later_buckets_gradients(two_replicas):
    with two_replicas.scope():
        model = _mlp()
        optimizer = nonfinite.wrap_optimizer(
            keras.optimizers.SGD(0.1), nonfinite="skip", bucket_cap_mb=1e-6)
        optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    captured = []

    def replica_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        gradients = tape.gradient(loss, variables)
        context = tf.distribute.get_replica_context()
        step = optimizer.exchange.exchange(exchanges.Step(context, gradients, variables))
        captured.append(gradients)
        return step.gradients

    @tf.function
    def run(x):
        return two_replicas.run(replica_step, args=(x,))

    graph = run.get_concrete_function(tf.TensorSpec([4, 6])).graph
    collectives = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    # One per bucket (every variable its own: 6) per replica.
    assert len(collectives) == 2 * len(variables)
    producers = {}
    for gradients in captured:
        for index, gradient in enumerate(gradients):
            producers[gradient.op.name] = index
    checked = 0
    for collective in collectives:
        # The gradient it sums: the one its tensor is made of.
        (own,) = {producers[a.name] for a in _ancestors(collective.inputs[0].op, control=False)
                  if a.name in producers}
        waits_for = {producers[a.name] for a in _ancestors(collective) if a.name in producers}
        # It may wait for the later layers' gradients (earlier buckets, whose
        # all-reduces the ordering token puts first), never an earlier layer's.
        assert min(waits_for) == own, (collective.name, own, sorted(waits_for))
        checked += 1
    assert checked == len(collectives)


def _fit(strategy, form, **kwargs):
    with strategy.scope():
        model = form.model()
        tfdp.compile(model, optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=form.loss(),
                     **form.compile_kwargs, **kwargs)
    history = model.fit(form.dataset(), epochs=1, verbose=0, **form.fit_kwargs())
    return model, loss_forms.weights(model), history.history


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:tfdp. loss")
@pytest.mark.parametrize("form_name", [form.name for form in FORMS])
def test_every_loss_form_equals_the_plain_all_reduce_and_one_device(form_name, two_replicas):
    form = FORMS_BY_NAME[form_name]
    initial, expected, history = loss_forms.keras_one_device(form)
    _, plain, plain_history = _fit(two_replicas, form)
    model, final, got = _fit(two_replicas, form, bucket_cap_mb=1e-6)
    assert isinstance(model.optimizer.exchange, bucketed.Bucketed)
    deviation = loss_forms.relative_deviation(initial, plain, final)
    assert deviation < 1e-6, f"off the plain all-reduce by {deviation:.2e} of the update"
    np.testing.assert_allclose(got["loss"], plain_history["loss"], rtol=1e-6)
    # As tests/training/test_loss_normalization.py holds the plain all-reduce.
    deviation = loss_forms.relative_deviation(initial, expected, final)
    assert deviation < 1e-5, f"off one device by {deviation:.2e} of the update"
    np.testing.assert_allclose(got["loss"][-1], history["loss"][-1], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1e-6, 1e-4, 25.0])
def test_equals_the_plain_all_reduce(cap, two_replicas):
    form = FORMS_BY_NAME["regularizers_add_loss"]
    _, plain, _ = _fit(two_replicas, form)
    _, got, _ = _fit(two_replicas, form, bucket_cap_mb=cap)
    for a, b in zip(got, plain):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value", [0, -1.0, "25", True, float("inf")])
def test_a_bad_cap_is_refused_by_name(value, two_replicas):
    with two_replicas.scope():
        model = _mlp()
        with pytest.raises(ValueError, match="bucket_cap_mb") as error:
            tfdp.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse",
                         bucket_cap_mb=value)
    assert "Received: bucket_cap_mb=" in str(error.value)


def test_the_cap_is_in_the_wrappers_config(two_replicas):
    with two_replicas.scope():
        optimizer = nonfinite.wrap_optimizer(
            keras.optimizers.SGD(0.1), nonfinite="skip", bucket_cap_mb=0.5)
        config = optimizer.get_config()
        again = type(optimizer).from_config(config)
    assert config["bucket_cap_mb"] == 0.5 and again.bucket_cap_mb == 0.5
    assert isinstance(again.exchange, bucketed.Bucketed)


def test_one_inter_op_thread_is_warned_about(monkeypatch):
    """With one inter-op thread no bucket starts before the backward pass ends (see the module)."""
    exchange = bucketed.Bucketed(None, bucket_cap_mb=1.0)
    monkeypatch.setattr(tf.config.threading, "get_inter_op_parallelism_threads", lambda: 1)
    with pytest.warns(UserWarning, match="set_inter_op_parallelism_threads\\(2\\)"):
        exchange.build([])
    monkeypatch.setattr(tf.config.threading, "get_inter_op_parallelism_threads", lambda: 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exchange.build([])
