"""Tests for tfdp.BatchConfig: per-replica × replicas × accumulation = global."""

import pytest

from tfdp.training.batch import BatchConfig


@pytest.mark.parametrize(
    "per_replica, replicas, accum, global_batch",
    [(32, 1, 1, 32), (32, 2, 1, 64), (32, 2, 4, 256), (1, 8, 3, 24)],
)
def test_global_batch_is_the_product(per_replica, replicas, accum, global_batch):
    batch = BatchConfig(per_replica, replicas, accum)
    assert batch.global_batch == global_batch
    assert batch.replica_batch == per_replica * accum
    assert BatchConfig.from_global(global_batch, replicas, accum) == batch


def test_describe_states_all_four_numbers():
    line = BatchConfig(32, 2, 4).describe()
    assert line == (
        "batch: 32 per replica × 2 replica(s) × 4 accumulation step(s) = "
        "256 global examples per optimizer step"
    )


@pytest.mark.parametrize(
    "global_batch, replicas, accum, nearest",
    [(100, 8, 1, "96 or 104"), (250, 2, 4, "248 or 256"), (3, 2, 2, "4")],
)
def test_from_global_rejects_what_does_not_divide(global_batch, replicas, accum, nearest):
    with pytest.raises(ValueError, match=f"Received: global_batch={global_batch}") as error:
        BatchConfig.from_global(global_batch, replicas, accum)
    assert f"Nearest valid global batches: {nearest}." in str(error.value)
    assert f"{replicas} × {accum} = {replicas * accum}" in str(error.value)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(per_replica=0, num_replicas=1), "per_replica"),
        (dict(per_replica=4, num_replicas=0), "num_replicas"),
        (dict(per_replica=4, num_replicas=1, accum_steps=0), "accum_steps"),
        (dict(per_replica=4.0, num_replicas=1), "per_replica"),
        (dict(per_replica=True, num_replicas=1), "per_replica"),
    ],
)
def test_constructor_validates(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}` must be a positive integer"):
        BatchConfig(**kwargs)


def test_from_global_validates_global_batch():
    with pytest.raises(ValueError, match="`global_batch` must be a positive integer"):
        BatchConfig.from_global(0, 2)


def test_num_batches_of_plain_and_distributed_datasets():
    import tensorflow as tf

    import tfdp
    from tfdp.training.batch import num_batches

    dataset = tf.data.Dataset.range(10).batch(4)
    assert num_batches(dataset) == 3
    assert num_batches(dataset.repeat()) == -1  # infinite
    assert num_batches(dataset.filter(lambda x: True)) == -2  # unknown
    strategy = tfdp.make_strategy(cpu_replicas=2)
    distributed = strategy.experimental_distribute_dataset(dataset)
    assert num_batches(distributed) == 3
    assert num_batches(object()) == -2
