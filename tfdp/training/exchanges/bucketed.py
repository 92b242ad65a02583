"""The all-reduce during the backward pass: DDP's gradient buckets, each its own collective.

`AllReduce` sums every gradient in one batched all-reduce, which waits for
the last gradient of the backward pass. `Bucketed` cuts the gradients into
buckets as PyTorch DDP does (`bucket_assignment`): in reverse layer order,
the order the backward pass makes them, at most `bucket_cap_mb` MiB each and
the first at most 1 MiB (DDP's `first_bucket_bytes_cap`, so communication
starts early), one dtype per bucket. Each bucket is summed in an all-reduce
of its own that depends on that bucket's gradients only, so TensorFlow's
executor can start it while the backward pass computes the earlier layers'
gradients.

What TensorFlow allows (2.21; read in
`tensorflow/python/distribute/cross_device_utils.py`): every collective of a
replica takes its launcher's ordering token, a resource that automatic
control dependencies use to chain the collectives in the order they were
created; nothing else is added, so bucket k waits for its own gradients and
for bucket k-1's all-reduce (as DDP's buckets queue on one NCCL stream).
Collective ops are asynchronous kernels: the ring runs on the collective
executor's and gRPC's threads, not on the inter-op thread that computes.
But the executor launches a ready collective through the inter-op pool,
while it runs the backward pass's chain of ops inline on its thread: with
one inter-op thread (`tf.config.threading.set_inter_op_parallelism_threads(1)`)
no bucket starts before the backward pass ends (profiled on 2 workers over
100 Mbit/s, `tfdp.bench.bucket_trace`: 0 of 6 buckets, every step; with 2
threads the first starts a few ms into it). `build` warns then.
The strategy's own packing (`bytes_per_pack`, reversed too) would split
one call's tensors by size alone; each bucket is handed over whole (its
`bytes_per_pack` set to its own size) so the buckets are exactly these.

Exact as `AllReduce` (each element is summed over the same replicas); a
deferred global divisor rides in the first float32 bucket (it is known
before the backward pass), riders (timings taken after it) in the last.
With one replica nothing is exchanged. No per-replica state.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import tensorflow as tf

from tfdp import _checks
from tfdp.distribute import reduction
from tfdp.training.exchanges import base

#: DDP's cap on the first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`).
FIRST_BUCKET_BYTES = 1 << 20
#: DDP's default `bucket_cap_mb`.
DEFAULT_BUCKET_CAP_MB = 25.0
_MIB = 1 << 20


def check_bucket_cap_mb(bucket_cap_mb) -> None:
    """Raises ValueError unless `bucket_cap_mb` is None or a positive number of MiB."""
    if bucket_cap_mb is None:
        return
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not (
            bucket_cap_mb > 0 and bucket_cap_mb != float("inf")):
        raise ValueError(
            "`bucket_cap_mb` must be None (one all-reduce after the backward pass) or a "
            "positive number of MiB per gradient bucket (each bucket all-reduced during the "
            f"backward pass; PyTorch DDP's default is {DEFAULT_BUCKET_CAP_MB:g}). "
            f"Received: bucket_cap_mb={bucket_cap_mb!r}")


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One all-reduce: `indices` into the gradient list (ready order), `dtype`, `nbytes`."""

    indices: tuple
    dtype: str
    nbytes: int


def bucket_assignment(sizes: Sequence[tuple[int, str, bool]], cap_bytes: int,
                      first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """DDP's bucket assignment of gradients given in the order they become ready.

    As `torch.distributed._compute_bucket_assignment_by_size` (and the
    Reducer's rebuild in ready order): a bucket per dtype fills in order and
    closes once it holds at least its limit: `min(first_cap_bytes, cap_bytes)`
    for a dtype's first bucket, `cap_bytes` for its later ones.
    A sparse gradient (`tf.IndexedSlices`) is a bucket of its own. Buckets
    come in the order they closed, then the ones still open, by their first
    gradient.

    Args:
        sizes: per gradient, in ready order: `(bytes, dtype name, sparse)`.
        cap_bytes: the bucket cap, bytes (positive).
        first_cap_bytes: the first bucket's cap, bytes.

    Returns:
        The buckets, in the order their all-reduces are issued.
    """
    _checks.check_int("cap_bytes", cap_bytes)
    _checks.check_int("first_cap_bytes", first_cap_bytes)
    closed: list[Bucket] = []
    filling: dict[str, tuple] = {}  # dtype -> (indices, bytes)
    limits: dict[str, int] = {}  # dtype -> the limit of its bucket being filled
    for index, (nbytes, dtype, sparse) in enumerate(sizes):
        if sparse:
            closed.append(Bucket((index,), dtype, nbytes))
            continue
        indices, total = filling.pop(dtype, ((), 0))
        indices, total = indices + (index,), total + nbytes
        limit = limits.setdefault(dtype, min(first_cap_bytes, cap_bytes))
        if total >= limit:
            closed.append(Bucket(indices, dtype, total))
            limits[dtype] = cap_bytes
        else:
            filling[dtype] = (indices, total)
    rest = sorted(filling.items(), key=lambda item: item[1][0][0])
    return closed + [Bucket(indices, dtype, total) for dtype, (indices, total) in rest]


def _size(gradient) -> tuple[int, str, bool]:
    sparse = isinstance(gradient, tf.IndexedSlices)
    values = gradient.values if sparse else gradient
    elements = values.shape.num_elements()
    if elements is None:
        raise ValueError(
            f"bucket_cap_mb needs gradients of known shape to size its buckets; got "
            f"{values.shape} for a {values.dtype.name} gradient. Use bucket_cap_mb=None.")
    return elements * values.dtype.size, values.dtype.name, sparse


class Bucketed(base.Exchange):
    """All-reduce SUM of the gradients in DDP's buckets, each started when its gradients exist.

    Args:
        optimizer: the wrapper it exchanges for.
        bucket_cap_mb: MiB per bucket (the first at most 1 MiB).
        all_reduce_dtype: `None` or `"bfloat16"` (buckets are sized in the
            gradients' own bytes, as DDP sizes them before a hook).
    """

    def __init__(self, optimizer, bucket_cap_mb: float, all_reduce_dtype: str | None = None):
        super().__init__(optimizer)
        check_bucket_cap_mb(bucket_cap_mb)
        reduction.check_all_reduce_dtype(all_reduce_dtype)
        self.bucket_cap_mb = bucket_cap_mb
        self.all_reduce_dtype = all_reduce_dtype

    @property
    def accepts_global_divisor(self) -> bool:
        return self.all_reduce_dtype is None

    @property
    def carries_riders(self) -> bool:
        return self.all_reduce_dtype is None

    def build(self, variables: list) -> None:
        del variables
        if tf.config.threading.get_inter_op_parallelism_threads() == 1:
            warnings.warn(
                f"bucket_cap_mb={self.bucket_cap_mb}: with one inter-op thread TensorFlow "
                "starts no bucket's all-reduce before the backward pass ends, so nothing "
                "overlaps. Call tf.config.threading.set_inter_op_parallelism_threads(2) (or "
                "leave it at 0, TensorFlow's default) before TensorFlow starts, or use "
                "bucket_cap_mb=None.", stacklevel=2)

    def buckets(self, gradients: list) -> list[Bucket]:
        """The buckets of `gradients` (given in layer order), as indices into that list."""
        ready = list(reversed(range(len(gradients))))
        assignment = bucket_assignment([_size(gradients[i]) for i in ready],
                                       max(1, round(self.bucket_cap_mb * _MIB)))
        return [dataclasses.replace(b, indices=tuple(ready[i] for i in b.indices))
                for b in assignment]

    def exchange(self, step: base.Step) -> base.Step:
        context = step.context
        if context.num_replicas_in_sync == 1:
            return step
        buckets = self.buckets(step.gradients)
        float32 = [i for i, b in enumerate(buckets) if b.dtype == "float32"]
        riding = {}  # bucket position -> [(field, tensor)]
        if step.divisor is not None:
            riding.setdefault(float32[0] if float32 else len(buckets), []).append(
                ("divisor", step.divisor))
        if step.riders is not None:
            riding.setdefault(float32[-1] if float32 else len(buckets), []).append(
                ("riders", step.riders))
        summed = list(step.gradients)
        sums = {}
        for position in range(len(buckets) + 1):
            bucket = buckets[position] if position < len(buckets) else None
            exact = riding.get(position, [])
            if bucket is None and not exact:
                continue
            tensors = [] if bucket is None else [step.gradients[i] for i in bucket.indices]
            options = tf.distribute.experimental.CommunicationOptions(
                bytes_per_pack=max(1, sum(_size(t)[0] for t in tensors + [e for _, e in exact])))
            result = reduction.all_reduce_sum(context, tensors, self.all_reduce_dtype,
                                              exact=[e for _, e in exact], options=options)
            reduced, exact_sums = result if exact else (result, [])
            for index, value in zip(() if bucket is None else bucket.indices, reduced):
                summed[index] = value
            sums.update({name: value for (name, _), value in zip(exact, exact_sums)})
        return step.replace(gradients=summed, reduced=True, divisor=sums.get("divisor"),
                            riders=sums.get("riders"))
