"""What a `make_dataset` pipeline delivers: `PipelineInfo`, the step and example accounting.

This module owns the record a training loop reads about a dataset (steps
per epoch, examples seen and dropped, the batch arithmetic, how the input
was sharded, the element structure) and its one-line description. Building
the pipeline is `tfdp.pipelines.input_pipeline`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tfdp


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """What a training loop needs to know about a dataset from `make_dataset`.

    Available as `dataset.pipeline_info` (and `dataset.steps_per_epoch`,
    `dataset.num_examples`).

    Attributes:
        source: the source's name.
        split: the split read.
        training: whether built for training.
        num_examples: examples in the split (`pipelines.INFINITE` if endless).
        num_classes: label classes when the source knows them, else `None`.
        steps_per_epoch: global steps per epoch, the same on every worker;
            `None` for an endless source.
        batch: the batch arithmetic, a `tfdp.BatchConfig` (`global_batch`,
            `num_replicas`, `accum_steps`, and `per_replica`, the
            micro-batch); also as the properties below.
        num_input_pipelines: input pipelines (workers, or replicas with a
            MirroredStrategy).
        shard_mode: how the split is divided (see `tfdp.pipelines.sharding`).
        shard_reason: why.
        pipeline_sizes: examples each input pipeline reads per epoch.
        examples_per_epoch: real examples seen per epoch.
        dropped_per_epoch: examples dropped per epoch (the final partial
            global batch), 0 unless `drop_remainder`.
        partial_batches_per_epoch: per-replica batches per epoch, over all
            pipelines, with fewer than `per_replica_batch` examples (some
            possibly empty); 0 when `drop_remainder`.
        element_spec: one unbatched `(features, label)` example after
            `preprocess`.
    """

    source: str
    split: str
    training: bool
    num_examples: int
    num_classes: int | None
    steps_per_epoch: int | None
    batch: tfdp.BatchConfig
    num_input_pipelines: int
    shard_mode: str
    shard_reason: str
    pipeline_sizes: tuple[int, ...]
    examples_per_epoch: int | None
    dropped_per_epoch: int
    partial_batches_per_epoch: int
    element_spec: Any

    @property
    def global_batch(self) -> int:
        """Examples per step, all replicas together."""
        return self.batch.global_batch

    @property
    def per_replica_batch(self) -> int:
        """Examples each replica receives per step (what a pipeline batches at)."""
        return self.batch.replica_batch

    @property
    def micro_batch(self) -> int:
        """`per_replica_batch // accum_steps`."""
        return self.batch.per_replica

    @property
    def accum_steps(self) -> int:
        """Micro-batches per replica per optimizer step."""
        return self.batch.accum_steps

    @property
    def num_replicas(self) -> int:
        """Replicas in sync."""
        return self.batch.num_replicas

    def describe(self) -> str:
        """One line for the start-up log."""
        batch = (
            f"global batch {self.global_batch} = {self.num_replicas} replica(s) x "
            f"{self.per_replica_batch}"
            + (
                f" (= {self.accum_steps} micro-batches of {self.micro_batch})"
                if self.accum_steps > 1
                else ""
            )
        )
        if self.steps_per_epoch is None:
            epoch = "endless source"
        else:
            epoch = f"{self.steps_per_epoch} steps/epoch"
            if self.dropped_per_epoch:
                epoch += (
                    f", {self.dropped_per_epoch} example(s) dropped per epoch "
                    f"(final partial global batch)"
                )
            if self.partial_batches_per_epoch:
                epoch += (
                    f", {self.partial_batches_per_epoch} partial or empty "
                    f"per-replica batch(es) per epoch"
                )
        return (
            f"{self.source}/{self.split}: {self.num_examples} examples, {batch}; "
            f"{epoch}; {self.num_input_pipelines} input pipeline(s), shard "
            f"{self.shard_mode} ({self.shard_reason})"
        )
