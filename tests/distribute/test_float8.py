"""`Float8` (`gradient_compression="float8"`) against a NumPy reference of the same scaling and rounding.

Fixed per-replica gradient shares for several steps go through the
compressor on 2 logical CPU replicas (a MirroredStrategy that counts its
collectives); every step's sums and every replica's error memories must
equal a NumPy simulation with `ml_dtypes.float8_e4m3fn` (per-tensor scale
the least power of two 2^k with max|M| <= 448 · 2^k, round to nearest even, error feedback), and each replica must
send a quarter of float32's bytes (plus one scale per tensor) in one
all-gather. The E4M3 codes must be exact for all 256 of them, a NaN must
reach every replica's sum, and `tfdp.compile` must train with it and refuse
it beside an `all_reduce_dtype`.
"""

from __future__ import annotations

import math

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import strategy_testing
import tfdp
from tfdp.distribute import float8

REPLICAS = 2
STEPS = 4
SHAPES = [(3, 3, 2, 8), (20, 12), (12,), (3, 2)]


def shares(seed=5):
    """`[step][replica][variable]` float32 gradient shares, of different magnitudes per tensor."""
    rng = np.random.default_rng(seed)
    return [[[(rng.normal(size=s) * 10.0 ** (i - 2)).astype("float32")
              for i, s in enumerate(SHAPES)] for _ in range(REPLICAS)] for _ in range(STEPS)]


def power_of_two_scale(amax):
    """The least power of two 2^k with amax <= 448 · 2^k (1 for 0), as float32."""
    if amax == 0:
        return np.float32(1.0)
    k = math.ceil(math.log2(amax / 448.0))
    while 448.0 * 2.0**k < amax:
        k += 1
    while 448.0 * 2.0 ** (k - 1) >= amax:
        k -= 1
    return np.float32(2.0**k)


def reference(per_step):
    """NumPy: each step's sums, and the memories after the last step, `[replica][variable]`."""
    memories = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(REPLICAS)]
    outputs = []
    for step in per_step:
        sums = [np.zeros(s, np.float32) for s in SHAPES]
        for replica in range(REPLICAS):
            for i, gradient in enumerate(step[replica]):
                accumulated = gradient + memories[replica][i]
                scale = power_of_two_scale(float(np.max(np.abs(accumulated))))
                rounded = (accumulated / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
                sent = rounded * scale
                memories[replica][i] = accumulated - sent
                sums[i] = sums[i] + sent
        outputs.append(sums)
    return outputs, memories


def run(per_step):
    strategy, (calls, values, gathers) = strategy_testing.measuring_strategy(REPLICAS)
    compressor = float8.Float8()
    with strategy.scope():
        compressor.build([tf.Variable(tf.zeros(s)) for s in SHAPES])
    outputs = []
    for step in per_step:
        stacked = [tf.constant(np.stack([r[i] for r in step])) for i in range(len(SHAPES))]

        @tf.function
        def replica_fn():
            context = tf.distribute.get_replica_context()
            index = context.replica_id_in_sync_group
            sums, new_state = compressor.reduce(context, [s[index] for s in stacked])
            compressor.commit(new_state, tf.constant(True))
            return sums

        local = [strategy.experimental_local_results(s) for s in strategy.run(replica_fn)]
        for per_replica in local:
            np.testing.assert_array_equal(per_replica[1].numpy(), per_replica[0].numpy())
        outputs.append([per_replica[0].numpy() for per_replica in local])
    memories = [[strategy.experimental_local_results(v)[r].numpy() for v in compressor.state]
                for r in range(REPLICAS)]
    counts = (int(calls.numpy()), int(values.numpy()), int(gathers.numpy()))
    return outputs, memories, counts, compressor


def test_sums_and_memories_equal_the_numpy_reference_over_several_steps():
    per_step = shares()
    got, got_memories, _, _ = run(per_step)
    want, want_memories = reference(per_step)
    for got_step, want_step in zip(got, want):
        for g, w in zip(got_step, want_step):
            np.testing.assert_allclose(g, w, rtol=0, atol=0)
    for got_replica, want_replica in zip(got_memories, want_memories):
        for g, w in zip(got_replica, want_replica):
            np.testing.assert_allclose(g, w, rtol=0, atol=0)
    # Error feedback: what was left out is small beside what was sent, and not lost.
    assert any(np.abs(m).max() > 0 for m in want_memories[0])


def test_a_quarter_of_float32_bytes_in_one_all_gather_per_step():
    _, _, (all_reduces, values, all_gathers), compressor = run(shares())
    size = sum(math.prod(s) for s in SHAPES)
    per_step = math.ceil(size / 4) + len(SHAPES)  # codes four to an int32, one scale a tensor
    assert (all_reduces, all_gathers) == (0, STEPS)
    # The measuring strategy counts the float tensors only (as for Top-K's
    # int32 indices): here the scales, one per tensor.
    assert values == STEPS * len(SHAPES)
    assert compressor.values_sent([tf.zeros(s) for s in SHAPES]) == per_step
    assert 4 * per_step <= size + 4 * len(SHAPES) + 3  # a byte a value, against float32's 4


def test_every_e4m3_code_is_encoded_and_decoded_exactly():
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    decoded = float8._decode(tf.constant(codes.astype(np.int32))).numpy()
    np.testing.assert_array_equal(np.isnan(decoded), np.isnan(values))
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(decoded[finite], values[finite])
    encoded = float8._encode(tf.constant(values)).numpy()
    expected = np.where(values == 0, 0, np.where(finite, codes, 0x7F))  # -0 sent as 0
    np.testing.assert_array_equal(encoded, expected)


def test_a_nan_on_one_replica_reaches_every_sum():
    per_step = shares()[:1]
    per_step[0][1][2][3] = np.nan
    got, _, _, _ = run(per_step)
    assert np.isnan(got[0][2]).any()


@pytest.mark.slow
def test_compile_trains_with_float8_and_refuses_it_beside_an_all_reduce_dtype():
    strategy = tfdp.make_strategy(cpu_replicas=2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                     gradient_compression="float8")
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0).history["loss"]
    assert history[-1] < 0.5 * history[0]
    assert isinstance(model.optimizer.compressor, tfdp.compression.Float8)
    with pytest.raises(ValueError, match="float8.*all_reduce_dtype='bfloat16'"):
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                     gradient_compression="float8", all_reduce_dtype="bfloat16")
    with strategy.scope(), pytest.raises(ValueError, match="Pass all_reduce_dtype=None"):
        tfdp.compile(model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                     gradient_compression=tfdp.compression.Float8(), all_reduce_dtype="bfloat16")
