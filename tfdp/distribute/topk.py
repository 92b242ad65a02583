"""Top-K sparsification with error feedback.

Each replica adds its error memory to its share of the gradient, keeps the
k entries of largest magnitude over all of its gradients (one flat vector of
every trainable value, k = ⌈fraction · size⌉), and the replicas exchange
those (index, value) pairs with one all-gather; every replica then adds
them up into the same dense sum. The entries not sent stay in the memory
(Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
Lin et al., "Deep Gradient Compression", ICLR 2018, without its momentum
correction and warm-up):

    M = G + E
    I = indices of the k largest |M|
    sum = Σ_replicas scatter(I, M[I])    one all-gather of k indices + k values
    E = M with the entries at I set to 0

Indices travel as int32, so up to 2³¹ − 1 trainable values. With
`all_reduce_dtype="bfloat16"` the values travel as bfloat16, packed two to
an int32 (6 bytes a pair instead of 8); what the rounding leaves out of a
sent value stays in the memory, so it is sent later as the unsent entries
are.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tfdp.distribute import compression
from tfdp.distribute import reduction


class TopK(compression.GradientCompressor):
    """Top-K sparsification with error feedback (`tfdp.compression.TopK`).

    Args:
        fraction: the share of all trainable values each replica sends per
            step, in (0, 1]; at least one value is sent.
    """

    def __init__(self, fraction: float = 0.01):
        compression.check_fraction("fraction", fraction)
        super().__init__()
        self.fraction = float(fraction)
        self._sizes: list[int] = []

    def k(self, size: int) -> int:
        """Entries sent per replica per step out of `size` trainable values."""
        return max(1, min(size, math.ceil(self.fraction * size)))

    def _build(self, variables):
        self._sizes = [int(math.prod(v.shape)) for v in variables]
        total = sum(self._sizes)
        if total >= 2**31:
            raise ValueError(f"TopK indexes trainable values with int32; this model has {total}.")
        self._memory = compression.state_variable(tf.zeros([total]), "topk_error")
        self.state = [self._memory]

    def reduce(self, context, gradients, all_reduce_dtype=None):
        reduction.check_all_reduce_dtype(all_reduce_dtype)
        total = sum(self._sizes)
        flat = tf.concat([tf.zeros([n]) if g is None else tf.reshape(tf.cast(g, tf.float32), [-1])
                          for g, n in zip(gradients, self._sizes)], 0)
        # A variable without a gradient sends nothing and keeps its memory.
        present = tf.concat([tf.fill([n], g is not None) for g, n in zip(gradients, self._sizes)], 0)
        memory = self._memory.read_value()
        accumulated = flat + tf.where(present, memory, 0.0)
        # A NaN or Inf ranks first: it must reach every replica's sum, so that
        # all of them skip the step alike (tfdp.training.nonfinite).
        magnitude = tf.where(tf.math.is_finite(accumulated), tf.abs(accumulated), float("inf"))
        magnitude = tf.where(present, magnitude, -1.0)
        _, indices = tf.math.top_k(magnitude, k=self.k(total), sorted=False)
        values = tf.gather(accumulated, indices)
        if all_reduce_dtype is not None:
            values = tf.cast(values, all_reduce_dtype)
        # What is sent leaves the memory; its rounding (if any) stays in it.
        new_memory = tf.tensor_scatter_nd_sub(
            accumulated, indices[:, None], tf.cast(values, tf.float32)
        )
        if all_reduce_dtype is None:
            all_indices, all_values = context.all_gather([indices, values], axis=0)
        else:
            all_indices, all_values = _gather_16_bit(context, indices, values)
        # scatter_nd adds the values of repeated indices: the sum over replicas.
        summed = tf.scatter_nd(all_indices[:, None], tf.cast(all_values, tf.float32), [total])
        sums = [None if g is None else tf.cast(tf.reshape(part, tf.shape(g)), g.dtype)
                for g, part in zip(gradients, tf.split(summed, self._sizes))]
        return sums, [tf.where(present, new_memory, memory)]

    def values_sent(self, variables) -> int:
        """Values of 4 bytes sent per replica per step: k indices and k values (float32)."""
        return 2 * self.k(sum(int(math.prod(v.shape)) for v in variables))

    def get_config(self) -> dict:
        return {"fraction": self.fraction}

    def __repr__(self) -> str:
        return f"TopK(fraction={self.fraction})"


def _gather_16_bit(context, indices, values):
    """All-gathers `indices` (int32) and 16-bit `values`, the values two to an int32.

    TensorFlow's collective all-gather (CollectiveGatherV2, what
    MirroredStrategy and MultiWorkerMirroredStrategy use) takes no bfloat16
    tensor, so the values travel bit for bit as int32 pairs: 2 bytes each,
    exactly. Returns `(all_indices, all_values)` in replica order, as
    `context.all_gather` would.
    """
    k = values.shape[0]
    pairs = tf.reshape(tf.pad(values, [[0, k % 2]]), [-1, 2])
    all_indices, packed = context.all_gather([indices, tf.bitcast(pairs, tf.int32)], axis=0)
    unpacked = tf.reshape(tf.bitcast(packed, values.dtype), [context.num_replicas_in_sync, -1])
    return all_indices, tf.reshape(unpacked[:, :k], [-1])
