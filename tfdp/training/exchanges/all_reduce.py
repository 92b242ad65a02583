"""The plain exchange: one batched all-reduce SUM of the gradients, in their dtype or bfloat16.

Each replica's gradients are summed over every replica and worker in one
collective (`tfdp.distribute.reduction.all_reduce_sum`); with
`all_reduce_dtype="bfloat16"` float32 gradients cross in bfloat16 (half the
bytes). A deferred global divisor (`Step.divisor`: the global example count
of `tfdp.training.loss_normalization`) rides in the same collective, exactly
in float32, so it costs nothing more; in bfloat16 it cannot (one concat of
mixed dtypes), so that case is not offered (`accepts_global_divisor`).
Riders (`Step.riders`: the per-replica compute seconds of balanced batches,
`tfdp.training.balanced_batches`) ride the same way, under the same rule
(`carries_riders`).

With one replica nothing is exchanged. No per-replica state.
"""

from __future__ import annotations

from tfdp.distribute import reduction
from tfdp.training.exchanges import base


class AllReduce(base.Exchange):
    """All-reduce SUM of the gradients, in `all_reduce_dtype` (`None`: their own dtype).

    Args:
        optimizer: the wrapper it exchanges for.
        all_reduce_dtype: `None` or `"bfloat16"`.
    """

    def __init__(self, optimizer, all_reduce_dtype: str | None = None):
        super().__init__(optimizer)
        reduction.check_all_reduce_dtype(all_reduce_dtype)
        self.all_reduce_dtype = all_reduce_dtype

    @property
    def accepts_global_divisor(self) -> bool:
        return self.all_reduce_dtype is None

    @property
    def carries_riders(self) -> bool:
        return self.all_reduce_dtype is None

    @property
    def scatterable(self) -> bool:
        return self.all_reduce_dtype is None

    def exchange(self, step: base.Step) -> base.Step:
        context = step.context
        if context.num_replicas_in_sync == 1:
            return step
        exact = [t for t in (step.divisor, step.riders) if t is not None]
        if not exact:
            gradients = reduction.all_reduce_sum(context, step.gradients, self.all_reduce_dtype)
            return step.replace(gradients=gradients, reduced=True)
        gradients, sums = reduction.all_reduce_sum(
            context, step.gradients, self.all_reduce_dtype, exact=exact)
        sums = iter(sums)
        return step.replace(
            gradients=gradients, reduced=True,
            divisor=None if step.divisor is None else next(sums),
            riders=None if step.riders is None else next(sums))
