"""Output shards: contiguous position ranges, dealt round-robin to workers."""

import pytest

from tfdp.inference.shard_layout import MAX_DEFAULT_SHARD_SIZE
from tfdp.inference.shard_layout import ShardLayout
from tfdp.inference.shard_layout import default_shard_size


def test_shards_cover_every_position_once_whatever_the_worker_count():
    layout = ShardLayout(1797, 100)
    assert layout.num_shards == 18
    assert layout.bounds(0) == (0, 100)
    assert layout.bounds(17) == (1700, 97)
    for workers in (1, 2, 3, 5):
        positions = []
        for worker in range(workers):
            for shard in layout.shards_of_worker(worker, workers):
                first, count = layout.bounds(shard)
                positions.extend(range(first, first + count))
        assert sorted(positions) == list(range(1797))


def test_done_shards_are_left_out_and_the_rest_keep_their_owner():
    layout = ShardLayout(1000, 100)
    assert layout.shards_of_worker(1, 2) == [1, 3, 5, 7, 9]
    assert layout.shards_of_worker(1, 2, done={3, 9, 4}) == [1, 5, 7]
    assert layout.shard_of(399) == 3 and layout.shard_of(400) == 4


def test_default_size_is_whole_batches_about_four_shards_per_worker_and_capped():
    assert default_shard_size(1797, num_workers=2, per_worker_batch=64) == 256
    assert default_shard_size(10, num_workers=2, per_worker_batch=64) == 64
    big = default_shard_size(10**8, num_workers=2, per_worker_batch=1000)
    assert big % 1000 == 0 and MAX_DEFAULT_SHARD_SIZE <= big < MAX_DEFAULT_SHARD_SIZE + 1000


@pytest.mark.parametrize("examples, size", [(0, 10), (10, 0)])
def test_empty_input_or_shard_size_is_refused(examples, size):
    with pytest.raises(ValueError, match="num_examples|shard_size"):
        ShardLayout(examples, size)
