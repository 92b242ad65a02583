"""How a split is divided among input pipelines, and how many steps that makes.

This module owns two pure decisions, made identically in every worker process
from metadata alone (no data is read, nothing is communicated):

1. `plan_sharding`: which examples each input pipeline reads.
   - `"file"`: the source gives each pipeline whole files (TFDS's
     `ReadConfig(input_context=...)`): pipeline `i` reads files `i, i+n, ...`.
   - `"data"`: every pipeline reads the split in the same order and keeps
     every n-th example (`Dataset.shard(n, i)`).
   - `"context"`: the source shards itself by the input context (a callable
     source, or `TFRecordSource` by record when its count is given).
   - `"off"`: every pipeline reads everything (deliberate duplication).
   - `"none"`: there is one pipeline; nothing to divide.
   `shard_policy="auto"` picks `"file"` when the split has at least as many
   files as pipelines **and** the file split costs no step compared with
   element sharding (unequal files would otherwise drop or pad more than the
   final partial global batch); else `"data"`. It never falls back to every
   worker reading everything, which is what TensorFlow's own AUTO policy does
   silently when it cannot find files.

2. `steps_per_epoch`: the step count every pipeline must produce. Training
   with `drop_remainder` takes the smallest pipeline's full steps (so the only
   loss is the final partial global batch); otherwise every pipeline pads up
   to the largest pipeline's step count. Either way every worker runs the same
   number of steps, which MultiWorkerMirroredStrategy needs to not hang.

Building the datasets from the plan is `tfdp.pipelines.distributed_dataset`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from tfdp.pipelines import source as source_lib

POLICIES = ("auto", "file", "data", "off")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which examples each input pipeline reads.

    Attributes:
        mode: `"none"`, `"file"`, `"data"`, `"context"` or `"off"` (see the
            module docstring).
        sizes: examples each pipeline reads per epoch, in pipeline order
            (`source.INFINITE` for endless sources).
        reason: one sentence for the log: why this mode.
    """

    mode: str
    sizes: tuple[int, ...]
    reason: str

    @property
    def reads_with_context(self) -> bool:
        """Whether pipelines read `source.read(input_context=...)`."""
        return self.mode in ("file", "context")


def element_shard_sizes(total: int, num_pipelines: int) -> list[int]:
    """Examples `Dataset.shard(num_pipelines, i)` keeps of `total`, for each i."""
    if total == source_lib.INFINITE:
        return [source_lib.INFINITE] * num_pipelines
    return [len(range(i, total, num_pipelines)) for i in range(num_pipelines)]


def steps_per_epoch(
    sizes: Sequence[int], *, examples_per_step: int, drop_remainder: bool
) -> int | None:
    """The number of steps every pipeline produces per epoch.

    Args:
        sizes: examples per pipeline.
        examples_per_step: examples one pipeline contributes to one global
            step (per-replica batch times the replicas it feeds).
        drop_remainder: drop what does not fill a step on every pipeline
            (training), or pad every pipeline up to the longest (evaluation).

    Returns:
        The step count, or `None` for an endless source.
    """
    if any(size == source_lib.INFINITE for size in sizes):
        return None
    if drop_remainder:
        return min(size // examples_per_step for size in sizes)
    return max(math.ceil(size / examples_per_step) for size in sizes)


def plan_sharding(
    policy: str,
    *,
    num_pipelines: int,
    total: int,
    context_sizes: Sequence[int] | None,
    shards_by_file: bool,
    num_files: int | None,
    examples_per_step: int,
    drop_remainder: bool,
    source_name: str,
) -> ShardPlan:
    """Decides how `num_pipelines` input pipelines divide a split.

    Args:
        policy: `"auto"`, `"file"`, `"data"` or `"off"`.
        num_pipelines: input pipelines (`InputContext.num_input_pipelines`).
        total: examples in the split, or `source.INFINITE`.
        context_sizes: examples each pipeline would get from the source's own
            sharding (`Source.context_shard_sizes`), or `None` if it has none.
        shards_by_file: whether the source's own sharding is by file (TFDS)
            rather than a callable's own rule.
        num_files: files in the split, for messages; `None` if not file-backed.
        examples_per_step: as for `steps_per_epoch`.
        drop_remainder: as for `steps_per_epoch`.
        source_name: the source's name, for messages.

    Returns:
        A `ShardPlan`.

    Raises:
        ValueError: `policy="file"` for a source without (enough) files, or
            a callable source whose per-pipeline datasets neither partition
            the split nor each repeat all of it.
    """
    if policy not in POLICIES:
        raise ValueError(
            f"`shard_policy` must be one of {', '.join(map(repr, POLICIES))}. "
            f"Received: shard_policy={policy!r}"
        )
    by_context = "file" if shards_by_file else "context"

    if num_pipelines == 1:
        return ShardPlan("none", (total,), "one input pipeline reads the whole split")

    if policy == "off":
        if context_sizes is not None and not shards_by_file:
            return ShardPlan(
                "context",
                tuple(context_sizes),
                "shard_policy='off': the callable source's own datasets are used as given",
            )
        return ShardPlan(
            "off",
            (total,) * num_pipelines,
            f"shard_policy='off': each of the {num_pipelines} input pipelines "
            f"reads every example",
        )

    data_plan = ShardPlan(
        "data",
        tuple(element_shard_sizes(total, num_pipelines)),
        f"input pipeline i keeps examples i, i+{num_pipelines}, i+{2 * num_pipelines}, ...",
    )
    if policy == "data":
        return dataclasses.replace(data_plan, reason="shard_policy='data': " + data_plan.reason)

    if policy == "file":
        if not shards_by_file:
            raise ValueError(
                f"`shard_policy='file'` needs a source stored as files (a TFDS "
                f"dataset); {source_name!r} is not. Use shard_policy='auto' or "
                f"'data'."
            )
        if context_sizes is None:
            raise ValueError(
                f"`shard_policy='file'` needs at least as many files as input "
                f"pipelines, but {source_name!r} has "
                f"{num_files if num_files is not None else 'no known'} file(s) "
                f"for {num_pipelines} input pipelines. Use shard_policy='auto' "
                f"or 'data'."
            )
        _check_partition(context_sizes, total, source_name)
        return ShardPlan(
            "file",
            tuple(context_sizes),
            f"shard_policy='file': {num_files} files over {num_pipelines} input pipelines",
        )

    # policy == "auto"
    if total == source_lib.INFINITE:
        return dataclasses.replace(data_plan, reason="endless source: " + data_plan.reason)
    if context_sizes is None:
        why = (
            f"{num_files} file(s) < {num_pipelines} input pipelines"
            if num_files is not None
            else "the source cannot shard itself"
        )
        return dataclasses.replace(data_plan, reason=f"{why}: {data_plan.reason}")
    if sum(context_sizes) == total:
        if not shards_by_file:
            return ShardPlan(
                "context",
                tuple(context_sizes),
                "the source shards itself by its input context",
            )
        file_steps = steps_per_epoch(
            context_sizes, examples_per_step=examples_per_step, drop_remainder=drop_remainder
        )
        data_steps = steps_per_epoch(
            data_plan.sizes, examples_per_step=examples_per_step, drop_remainder=drop_remainder
        )
        if file_steps == data_steps:
            return ShardPlan(
                by_context,
                tuple(context_sizes),
                f"{num_files} files over {num_pipelines} input pipelines",
            )
        return dataclasses.replace(
            data_plan,
            reason=(
                f"{num_files} files split unevenly over {num_pipelines} input "
                f"pipelines ({list(context_sizes)} examples) would make "
                f"{file_steps} steps instead of {data_steps}: {data_plan.reason}"
            ),
        )
    if all(size == total for size in context_sizes):
        return dataclasses.replace(
            data_plan,
            reason=(
                "the source returns every example to every input pipeline: "
                + data_plan.reason
            ),
        )
    raise _partition_error(context_sizes, total, source_name)


def _check_partition(sizes: Sequence[int], total: int, source_name: str) -> None:
    if sum(sizes) != total:
        raise _partition_error(sizes, total, source_name)


def _partition_error(sizes: Sequence[int], total: int, source_name: str) -> ValueError:
    return ValueError(
        f"The datasets {source_name!r} returns for each input pipeline "
        f"have {list(sizes)} examples, which neither partition its {total} "
        f"examples (they sum to {sum(sizes)}) nor each hold all of them. "
        f"Make the source either shard exactly by its input context "
        f"(dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)) "
        f"or ignore the context, or pass shard_policy='off' to use its "
        f"datasets as they are."
    )
