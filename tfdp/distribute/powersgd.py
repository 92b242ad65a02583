"""PowerSGD: low-rank gradient compression with error feedback and warm start.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1 (one
step of subspace iteration per training step) inside Algorithm 2 (error
feedback). For each gradient reshaped to an n×m matrix (a conv kernel
[kh, kw, c_in, c_out] becomes [kh·kw·c_in, c_out]), with this replica's
share G and error memory E, and Q the m×r matrix kept from the last step:

    M = G + E
    P = Σ_replicas M Q          first all-reduce  (n·r values)
    P̂ = orthonormal basis of P  (QR; its column signs cancel in P̂ Qᵀ)
    Q = Σ_replicas Mᵀ P̂         second all-reduce (m·r values)
    sum ≈ P̂ Qᵀ                   the same on every replica
    E = M − (P̂ Qᵀ) / replicas   this replica's part of what was left out

This is the paper's algorithm with means replaced by sums (tfdp's shares sum
to the gradient): P, Q and the estimate are the paper's, and E is the
paper's memory divided by the number of replicas. The error is taken
against the aggregated estimate, as in the paper's reference code and
PyTorch's `powerSGD_hook`. Q starts from a normal matrix drawn from the same
seed on every replica and is kept (warm start).

Vectors (biases, normalisation scales) and matrices where compression does
not pay (n·m < min_compression_ratio · (n + m)·r) are summed uncompressed
in the first all-reduce, batched with the P matrices: two collectives per
step in all.

With `all_reduce_dtype="bfloat16"` both collectives carry bfloat16 (P, Q
and the uncompressed tensors, cast back to float32 after each sum): half
the bytes again. The estimate is then built from the rounded sums, and the
error memory keeps what the rounding left out, as it keeps what the low
rank left out.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from tfdp.distribute import compression
from tfdp.distribute import reduction


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The n×m a gradient of `shape` is compressed as; None for vectors and scalars."""
    if len(shape) < 2:
        return None
    return int(math.prod(shape[:-1])), int(shape[-1])


class PowerSGD(compression.GradientCompressor):
    """Rank-`rank` PowerSGD with error feedback (`tfdp.compression.PowerSGD`).

    Args:
        rank: r, the rank of the approximation (≥ 1); a matrix smaller than
            that in either dimension uses its smaller dimension.
        start_step: optimizer steps all-reduced uncompressed before
            compression starts (the paper and PyTorch's hook warm up this
            way; error memories stay zero until then).
        min_compression_ratio: a matrix is compressed only when its n·m
            values are at least this many times the (n + m)·r it would send.
        seed: seed of the initial Q matrices (equal on every replica).
    """

    def __init__(self, rank: int = 4, start_step: int = 0, min_compression_ratio: float = 2.0,
                 seed: int = 0):
        compression.check_positive_int("rank", rank)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"`start_step` must be an integer ≥ 0. Received: start_step={start_step!r}")
        if (isinstance(min_compression_ratio, bool)
                or not isinstance(min_compression_ratio, (int, float))
                or not min_compression_ratio > 0):
            raise ValueError("`min_compression_ratio` must be a number > 0. "
                             f"Received: min_compression_ratio={min_compression_ratio!r}")
        super().__init__()
        self.rank = int(rank)
        self.start_step = int(start_step)
        self.min_compression_ratio = float(min_compression_ratio)
        self.seed = int(seed)
        self._plan: list = []

    def plan(self, shapes: Sequence[Sequence[int]]) -> list[tuple[int, int, int] | None]:
        """Per gradient shape, `(n, m, r)` when it is compressed, else None."""
        plan = []
        for shape in shapes:
            nm = matrix_shape(shape)
            if nm is None:
                plan.append(None)
                continue
            n, m = nm
            r = min(self.rank, n, m)
            plan.append((n, m, r) if n * m >= self.min_compression_ratio * (n + m) * r else None)
        return plan

    def _build(self, variables):
        self._plan = self.plan([v.shape for v in variables])
        self._memories, self._qs = [], []
        for index, (variable, entry) in enumerate(zip(variables, self._plan)):
            if entry is None:
                continue
            n, m, r = entry
            name = variable.name.replace(":", "_").replace("/", "_")
            self._memories.append(compression.state_variable(tf.zeros([n, m]), f"powersgd_error_{name}"))
            q = tf.random.stateless_normal([m, r], seed=[self.seed, index], dtype=tf.float32)
            self._qs.append(compression.state_variable(q, f"powersgd_q_{name}"))
        self.state = self._memories + self._qs

    def reduce(self, context, gradients, all_reduce_dtype=None):
        replicas = float(context.num_replicas_in_sync)
        plain = [g for g, entry in zip(gradients, self._plan) if entry is None and g is not None]
        compressed = list(zip([g for g, e in zip(gradients, self._plan) if e is not None],
                              [e for e in self._plan if e is not None], self._memories, self._qs))
        ms, ps = [], []
        for g, (n, m, _), memory, q in (c for c in compressed if c[0] is not None):
            matrix = tf.reshape(tf.cast(g, tf.float32), [n, m]) + memory.read_value()
            ms.append(matrix)
            ps.append(tf.matmul(matrix, q.read_value()))
        # First collective: the uncompressed gradients and every P, one batch,
        # all in `all_reduce_dtype` (one dtype per batch: a bfloat16 batch
        # cannot carry float32 tensors through the strategy's concat).
        sums = reduction.all_reduce_sum(context, plain + ps, all_reduce_dtype)
        plain_sums, p_sums = sums[:len(plain)], sums[len(plain):]
        bases = [tf.linalg.qr(p)[0] for p in p_sums]
        # Second collective: every Q, in the same dtype. What its rounding
        # leaves out of the estimate stays in the error memory below.
        q_sums = reduction.all_reduce_sum(
            context, [tf.matmul(matrix, basis, transpose_a=True) for matrix, basis in zip(ms, bases)],
            all_reduce_dtype,
        ) if ms else []
        estimates = [tf.matmul(basis, q, transpose_b=True) for basis, q in zip(bases, q_sums)]
        # A variable without a gradient (the same on every replica: known when
        # traced) sends nothing and keeps its memory and Q as they were.
        new_memories, new_qs, fresh = [], [], iter(zip(ms, estimates, q_sums))
        for g, _, memory, q in compressed:
            if g is None:
                new_memories.append(memory.read_value())
                new_qs.append(q.read_value())
            else:
                matrix, estimate, q_sum = next(fresh)
                new_memories.append(matrix - estimate / replicas)
                new_qs.append(q_sum)
        sums, plain_iter, est_iter = [], iter(plain_sums), iter(estimates)
        for g, entry in zip(gradients, self._plan):
            if g is None:
                sums.append(None)
            elif entry is None:
                sums.append(next(plain_iter))
            else:
                sums.append(tf.cast(tf.reshape(next(est_iter), tf.shape(g)), g.dtype))
        return sums, new_memories + new_qs

    def values_sent(self, variables) -> int:
        plan = self.plan([v.shape for v in variables])
        return sum(
            int(math.prod(v.shape)) if entry is None else (entry[0] + entry[1]) * entry[2]
            for v, entry in zip(variables, plan)
        )

    def get_config(self) -> dict:
        return {"rank": self.rank, "start_step": self.start_step,
                "min_compression_ratio": self.min_compression_ratio, "seed": self.seed}

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, start_step={self.start_step}, "
                f"min_compression_ratio={self.min_compression_ratio})")
