"""Which examples make which output shard, and which worker scores it.

Output shard `s` holds the examples at input positions
`[s * shard_size, min((s + 1) * shard_size, num_examples))`, and worker
`s % num_workers` scores it. Every process derives the same layout from three
numbers, so no process tells another what to do; a rerun with another number
of workers keeps the shards (and so the completed files) and only moves whose
turn each remaining shard is.
"""

from __future__ import annotations

import dataclasses
import math

#: The default shard size never exceeds this many examples, so that a killed
#: worker loses at most this much work.
MAX_DEFAULT_SHARD_SIZE = 65_536

#: The default gives each worker about this many shards: enough for a resume
#: to save most of the work, few enough to keep files large.
DEFAULT_SHARDS_PER_WORKER = 4


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How `num_examples` input examples divide into output shards.

    Attributes:
        num_examples: examples in the input, in input order (positions
            `0 .. num_examples - 1`).
        shard_size: examples per output shard (the last one may be shorter).
    """

    num_examples: int
    shard_size: int

    def __post_init__(self):
        if self.num_examples < 1:
            raise ValueError(f"The input has no examples. Received: num_examples={self.num_examples}")
        if self.shard_size < 1:
            raise ValueError(
                f"`shard_size` must be a positive number of examples. Received: "
                f"shard_size={self.shard_size}"
            )

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num_examples / self.shard_size)

    def bounds(self, shard: int) -> tuple[int, int]:
        """`(first position, example count)` of output shard `shard`."""
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} is outside 0..{self.num_shards - 1}")
        first = shard * self.shard_size
        return first, min(self.shard_size, self.num_examples - first)

    def shard_of(self, position: int) -> int:
        return position // self.shard_size

    def shards_of_worker(self, worker_index: int, num_workers: int, done=()) -> list[int]:
        """The shards `worker_index` of `num_workers` scores, minus those `done`."""
        done = set(done)
        return [s for s in range(worker_index, self.num_shards, num_workers) if s not in done]


def default_shard_size(num_examples: int, *, num_workers: int, per_worker_batch: int) -> int:
    """About `DEFAULT_SHARDS_PER_WORKER` shards per worker, in whole batches.

    Args:
        num_examples: examples in the input.
        num_workers: worker processes scoring them.
        per_worker_batch: examples one worker scores per step; the size is
            rounded up to a multiple of it so that only a shard's last batch
            can be partial.

    Returns:
        Examples per shard, at most `MAX_DEFAULT_SHARD_SIZE` (rounded to
        whole batches) and at least one batch.
    """
    target = math.ceil(num_examples / (num_workers * DEFAULT_SHARDS_PER_WORKER))
    target = min(target, MAX_DEFAULT_SHARD_SIZE)
    batches = max(1, math.ceil(target / per_worker_batch))
    return batches * per_worker_batch
