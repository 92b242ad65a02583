"""Batch arithmetic: per-replica, replicas, accumulation and global batch.

One training step is one optimizer step on one global batch, everywhere in
tfdp (progress bars, `steps_per_epoch`, learning-rate schedules, checkpoints).
This module owns the arithmetic that ties the four numbers together and the
line the chief logs about them, and counts the batches of a dataset; it does
not build datasets or train.
"""

from __future__ import annotations

import dataclasses

from tfdp import _checks


#: What `num_batches` returns for a dataset of infinite / unknown size (tf.data's values).
INFINITE = -1
UNKNOWN = -2


def num_batches(dataset) -> int:
    """Batches (steps) in `dataset`: -1 if infinite, -2 if unknown.

    Works for a `tf.data.Dataset`, whose `cardinality()` is a method returning
    a tensor, and for a distributed dataset, whose `cardinality` is a NumPy
    integer attribute (Keras' TF dataset adapter handles the same two cases).
    """
    value = getattr(dataset, "cardinality", None)
    if value is None:
        return -2
    if callable(value):
        value = value()
    return int(value)


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How one global batch is split over replicas and accumulation steps.

    Each optimizer step consumes one global batch. Every replica receives
    `per_replica * accum_steps` examples of it and processes them as
    `accum_steps` micro-batches of `per_replica` examples, summing their
    gradients locally; then one all-reduce averages the gradients over all
    replicas and the optimizer steps once.

    Attributes:
        per_replica: examples in one micro-batch on one replica (the batch a
            replica holds activations for at a time).
        num_replicas: replicas in sync, over all workers
            (`strategy.num_replicas_in_sync`).
        accum_steps: micro-batches accumulated per optimizer step. Defaults
            to 1 (no accumulation).

    Example:

    >>> batch = BatchConfig.from_global(256, num_replicas=2, accum_steps=4)
    >>> batch.per_replica, batch.global_batch
    (32, 256)
    """

    per_replica: int
    num_replicas: int
    accum_steps: int = 1

    def __post_init__(self):
        _checks.check_int("per_replica", self.per_replica)
        _checks.check_int("num_replicas", self.num_replicas)
        _checks.check_int("accum_steps", self.accum_steps, hint=" (1 means no accumulation)")

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step: per_replica × num_replicas × accum_steps."""
        return self.per_replica * self.num_replicas * self.accum_steps

    @property
    def replica_batch(self) -> int:
        """Examples one replica receives per optimizer step: per_replica × accum_steps."""
        return self.per_replica * self.accum_steps

    @classmethod
    def from_global(
        cls, global_batch: int, num_replicas: int, accum_steps: int = 1
    ) -> "BatchConfig":
        """Splits `global_batch` over `num_replicas` and `accum_steps`.

        Args:
            global_batch: examples per optimizer step over all replicas.
            num_replicas: replicas in sync.
            accum_steps: micro-batches per optimizer step. Defaults to 1.

        Returns:
            A `BatchConfig` whose `global_batch` equals `global_batch`.

        Raises:
            ValueError: an argument is not a positive integer, or
                `global_batch` is not a multiple of `num_replicas * accum_steps`
                (the message names the nearest valid global batches).
        """
        _checks.check_int("global_batch", global_batch)
        _checks.check_int("num_replicas", num_replicas)
        _checks.check_int("accum_steps", accum_steps, hint=" (1 means no accumulation)")
        unit = num_replicas * accum_steps
        if global_batch % unit:
            lower = (global_batch // unit) * unit
            nearest = [size for size in (lower, lower + unit) if size > 0]
            raise ValueError(
                f"`global_batch` must be a multiple of num_replicas × accum_steps "
                f"= {num_replicas} × {accum_steps} = {unit}, so that every replica "
                f"gets the same number of examples in every micro-batch. Received: "
                f"global_batch={global_batch}. Nearest valid global batches: "
                f"{' or '.join(map(str, nearest))}."
            )
        return cls(global_batch // unit, num_replicas, accum_steps)

    def describe(self) -> str:
        """The start-up line: all four numbers and how they relate."""
        return (
            f"batch: {self.per_replica} per replica × {self.num_replicas} "
            f"replica(s) × {self.accum_steps} accumulation step(s) = "
            f"{self.global_batch} global examples per optimizer step"
        )


def _leading_dimension(spec) -> int | None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (BatchConfig stays light)

    leaves = [s for s in tf.nest.flatten(spec, expand_composites=True)
              if isinstance(s, tf.TensorSpec) and s.shape.rank]
    return leaves[0].shape[0] if leaves else None


def check_first_batch(dataset, batch: BatchConfig, owner: str = "Trainer") -> None:
    """Refuses a dataset whose batches are not the global (or replica) batch `batch` says.

    A `tf.data.Dataset` must yield global batches of `batch.global_batch`
    examples (`tf.distribute` splits each over the replicas); a distributed
    dataset, batches of `batch.replica_batch` examples per replica. A dataset
    batched per replica and handed over as a `tf.data.Dataset` would train on
    global batches `num_replicas` times smaller than configured, silently
    (more steps per epoch, a learning rate tuned for another batch). The
    batch dimension is read from the dataset's static shapes; when a
    `tf.data.Dataset`'s is unknown (no `drop_remainder`), its first batch is
    read once. A distributed dataset without a static batch dimension is not
    checked.

    Raises:
        ValueError: the first batch has another size; the message says how
            to batch the dataset.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if isinstance(dataset, tf.data.Dataset):
        size = _leading_dimension(dataset.element_spec)
        if size is None:
            for element in dataset.take(1):
                leaves = [t for t in tf.nest.flatten(element) if t is not None and t.shape.rank]
                size = int(tf.shape(leaves[0])[0]) if leaves else None
        expected, kind = batch.global_batch, "global batches"
    elif isinstance(dataset, tf.distribute.DistributedDataset):
        size = _leading_dimension(dataset.element_spec)
        expected, kind = batch.replica_batch, "per-replica batches"
    else:
        return
    if size is None or size == expected:
        return
    if isinstance(dataset, tf.data.Dataset):
        fix = (f"Batch it with .batch({batch.global_batch}, drop_remainder=True): a "
               f"tf.data.Dataset holds global batches, which tf.distribute splits over the "
               f"{batch.num_replicas} replicas")
        if size * batch.num_replicas == batch.global_batch:
            fix = "It looks batched per replica. " + fix
    else:
        fix = (f"Batch each input pipeline with {batch.replica_batch} examples per replica "
               f"(batch.replica_batch)")
    raise ValueError(
        f"{owner}: the dataset's first batch holds {size} examples, but {batch.describe()} "
        f"expects {kind} of {expected}. {fix}, or build the BatchConfig for the batch you "
        f"mean (tfdp.BatchConfig.from_global(global_batch, num_replicas, accum_steps))."
    )
