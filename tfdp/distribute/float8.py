"""8-bit float (E4M3) gradients with a per-tensor scale and error feedback.

Each replica adds its error memory to its share of each gradient, scales the
result by a power of two so that its largest magnitude lands in (224, 448]
(448 is E4M3's largest finite value), rounds it to `float8_e4m3fn` (3 mantissa bits, round to nearest
even), and sends the 8-bit codes, four to an int32, with its float32 scale,
in one all-gather; every replica decodes every replica's codes and adds
them up in float32, in replica order, so all get the same sum. What the
rounding left out stays in the memory and is sent later (error feedback,
as for Top-K):

    M = G + E                                   per tensor
    s = 2^k, the least k with max|M| <= 448 · 2^k  (1 where M is all zero)
    Q = float32(e4m3(M / s)) * s
    sum = Σ_replicas Q                          one all-gather of P/4 int32 + T scales
    E = M − Q

Per step each replica sends one byte per gradient value plus 4 bytes per
tensor: a quarter of float32's bytes (half of bfloat16's). A power-of-two
scale makes the scaling exact, so only the E4M3 rounding loses anything. A NaN or Inf
gradient is sent as E4M3's NaN code, so every replica's sum is NaN and all
of them skip the step alike (`tfdp.training.verdict`).

The E4M3 codes are read from the rounded values' float32 bits, and decoded
by looking each code up in a table of E4M3's 256 values: TensorFlow rounds
to `float8_e4m3fn` (`tf.cast`) but cannot bitcast it, and its collectives
take no 8-bit float. (Computed with `log` and `pow` instead, the codes cost
the bench CNN's 288k gradient values 150 ms a step on 2 CPU workers, three
times the step itself.)
"""

from __future__ import annotations

import math

import tensorflow as tf

from tfdp.distribute import compression

#: E4M3's largest finite magnitude.
E4M3_MAX = 448.0
_NAN_CODE = 0x7F


def _encode(rounded: tf.Tensor) -> tf.Tensor:
    """int32 E4M3 codes (0..255) of float32 values that are exact E4M3 values, or NaN.

    A normal E4M3 value 2^e · (1 + m/8) (e from -6 to 8) has the float32
    exponent field e + 127 and m in its mantissa's top 3 bits: its code is
    (e + 7) · 8 + m. A subnormal one, m · 2^-9, has the code m. -0 is sent as 0.
    """
    bits = tf.bitwise.bitwise_and(tf.bitcast(rounded, tf.int32), 0x7FFFFFFF)  # |rounded|
    exponent = tf.bitwise.right_shift(bits, 23)
    normal = (exponent - 120) * 8 + tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 20), 7)
    subnormal = tf.cast(tf.abs(rounded) * 2.0**9, tf.int32)  # exact: m · 2^-9 · 2^9
    code = tf.where(exponent >= 127 - 6, normal, subnormal)
    sign = tf.cast(rounded < 0, tf.int32) * 128
    return tf.where(bits < 0x7F800000, sign + code, _NAN_CODE)  # Inf and NaN: NaN


def _code_value(code: int) -> float:
    """The value of E4M3 code `code` (0..255): NaN for 0x7F and 0xFF."""
    sign, bits = (-1.0 if code & 0x80 else 1.0), code & 0x7F
    if bits == _NAN_CODE:
        return math.nan
    exponent, mantissa = bits >> 3, bits & 7
    return sign * (2.0 ** (exponent - 7) * (1 + mantissa / 8) if exponent else mantissa * 2.0**-9)


#: Every E4M3 code's float32 value, by code.
_VALUES = tuple(_code_value(code) for code in range(256))


def _decode(codes: tf.Tensor) -> tf.Tensor:
    """float32 values of int32 E4M3 codes (0..255): one table look-up."""
    return tf.gather(tf.constant(_VALUES, tf.float32), codes)


def _power_of_two_scale(amax: tf.Tensor) -> tf.Tensor:
    """float32 `2^k` for the least integer k with `amax <= 448 · 2^k`; 1 where `amax` is 0 or not finite."""
    usable = tf.logical_and(amax > 0, tf.math.is_finite(amax))
    amax = tf.where(usable, amax, E4M3_MAX)
    k = tf.math.ceil(tf.math.log(amax / E4M3_MAX) / math.log(2.0))
    # log can be off by one near a power of two: the comparisons are exact.
    k = tf.where(E4M3_MAX * tf.pow(2.0, k) < amax, k + 1, k)
    k = tf.where(E4M3_MAX * tf.pow(2.0, k - 1) >= amax, k - 1, k)
    return tf.where(usable, tf.pow(2.0, k), 1.0)


class Float8(compression.GradientCompressor):
    """E4M3 gradients with a per-tensor scale and error feedback (`gradient_compression="float8"`).

    No arguments: the scale is a power of two per tensor and per step, from
    the tensor's largest magnitude after the error memory is added.
    """

    option_name = "float8"
    wire_dtype = "float8_e4m3fn"

    def _build(self, variables):
        self._sizes = [int(math.prod(v.shape)) for v in variables]
        self.state = [compression.state_variable(tf.zeros(v.shape, tf.float32),
                                                 f"float8_error_{i}")
                      for i, v in enumerate(variables)]

    def reduce(self, context, gradients, all_reduce_dtype=None):
        if all_reduce_dtype is not None:
            raise ValueError(
                f"Float8 sends 8-bit values, not all_reduce_dtype={all_reduce_dtype!r}. "
                "Pass all_reduce_dtype=None with gradient_compression='float8'.")
        codes, scales, new_state = [], [], []
        for gradient, memory in zip(gradients, self.state):
            if gradient is None:  # no gradient: nothing sent, the memory kept
                new_state.append(memory.read_value())
                continue
            accumulated = tf.cast(gradient, tf.float32) + memory.read_value()
            scale = _power_of_two_scale(tf.reduce_max(tf.abs(accumulated)))
            rounded = tf.cast(tf.cast(accumulated / scale, tf.dtypes.experimental.float8_e4m3fn),
                              tf.float32)
            new_state.append(accumulated - rounded * scale)
            codes.append(tf.reshape(_encode(rounded), [-1]))
            scales.append(scale)
        flat = tf.concat(codes, 0)
        total = flat.shape[0]
        padded = tf.pad(flat, [[0, (-total) % 4]])
        packed = tf.bitcast(tf.cast(tf.reshape(padded, [-1, 4]), tf.uint8), tf.int32)
        all_packed, all_scales = context.all_gather([packed, tf.stack(scales)], axis=0)
        replicas = context.num_replicas_in_sync
        all_codes = tf.reshape(tf.cast(tf.bitcast(all_packed, tf.uint8), tf.int32),
                               [replicas, -1])[:, :total]
        all_scales = tf.reshape(all_scales, [replicas, -1])
        present = [g for g in gradients if g is not None]
        sizes = [n for n, g in zip(self._sizes, gradients) if g is not None]
        summed = None
        for replica in range(replicas):  # in replica order: the same sum everywhere
            parts = tf.split(_decode(all_codes[replica]), sizes)
            values = [p * all_scales[replica, i] for i, p in enumerate(parts)]
            summed = values if summed is None else [a + b for a, b in zip(summed, values)]
        sums = iter(tf.cast(tf.reshape(s, tf.shape(g)), g.dtype) for s, g in zip(summed, present))
        return [None if g is None else next(sums) for g in gradients], new_state

    def values_sent(self, variables) -> int:
        """Values of 4 bytes sent per replica per step: the codes, four to a value, and one scale per tensor."""
        sizes = [int(math.prod(v.shape)) for v in variables]
        return math.ceil(sum(sizes) / 4) + len(sizes)

    def get_config(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return "Float8()"
