"""`make_dataset`: the input pipeline for `model.fit` and custom loops alike.

This module owns the public entry point and its contract: validating the
arguments (before anything is read or any collective runs) and handing one
`tfdp.pipelines.input_pipeline.InputPipeline` to
`strategy.distribute_datasets_from_function`. The batch arithmetic is
`tfdp.BatchConfig`'s; which examples each input pipeline reads, and the step
count, are decided in `tfdp.pipelines.sharding`; the sources are in
`tfdp.pipelines.source_registry`.

Contract (what every input pipeline guarantees):

- Each pipeline batches at `input_context.get_per_replica_batch_size(
  global_batch)`; every step consumes exactly one global batch. With
  `accum_steps = k` the training code later splits each replica's batch into
  k micro-batches; here we only check divisibility by replicas x k.
- One epoch visits every example exactly once across all workers and
  replicas. Training with `drop_remainder` (the training default) drops only
  what does not fill the last global batch (counted, and logged as a
  warning); every batch is full, so shapes are static. Evaluation never
  drops (`drop_remainder=True` with `training=False` is an error).
- Without `drop_remainder` (the evaluation default) nothing is dropped and
  nothing is added: a pipeline's last batch is partial, and a pipeline that
  runs out before the others yields *empty* batches (0 examples) until every
  pipeline has produced the same number of steps. This is
  `tf.distribute`'s own partial-batch semantics, made deterministic.
  Because no example is invented, every Keras metric (`metrics=` and
  `weighted_metrics=` alike) and the `loss` reported by `evaluate` equal the
  single-device values: Keras weights each replica's batch by its size.
  (The alternative, padding with zero-weight examples, would be exact only
  for `weighted_metrics`.) Layers that compute batch statistics in training
  (BatchNormalization) should not train on partial or empty batches: keep
  `drop_remainder=True` for training.
- Every pipeline produces exactly `steps_per_epoch` steps (enforced with
  `assert_cardinality`), so every MultiWorkerMirroredStrategy worker runs the
  same number of steps and none waits forever in a collective. The count is
  computed from the example counts, known from metadata or counted once.

Element structure: `(features, label)` tuples, as Keras unpacks them.
`features` may be a tensor or a dict/nest of tensors (for multi-input
models); every leaf needs a static shape after `preprocess` (the batch
dimension is static too when `drop_remainder`).

Order within a pipeline, training on a source that addresses its examples
(`digits`, TFDS datasets stored as TFRecord files, `TFRecordSource` with
known counts per file, the synthetic sources), uncached: a per-epoch random
order of its files, read a window of files at a time (about 10,000
examples) as raw records, each window visited in a random permutation
(`tfdp.pipelines.seekable_order`) -> parse/decode only the records visited ->
parallel preprocess -> batch -> prefetch. Otherwise: read (its files, or
every n-th example) -> cache -> shuffle (seeded, reshuffled every epoch) ->
take whole steps -> parallel preprocess -> batch -> empty batches up to the
step count -> prefetch (on the host; which strategies then copy batches to
the devices ahead of the step is noted in `tfdp.pipelines.input_pipeline`).

Resuming: the dataset's `start_at_batch(b)` is the same epoch from global
batch `b` on, the batches an uninterrupted epoch yields there (with a
`seed`). `tfdp.Trainer` and `tfdp.callbacks.BackupAndRestore` call it
(`tfdp.training.input_position`). In the first order above nothing before
the position is decoded or preprocessed and no window of files before it is
opened; otherwise the source reads (and decodes) the examples before the
position and they pass the shuffle buffer, but they are not preprocessed,
batched or copied to a device. Without a `seed` the order is random, so a
resumed epoch is not the interrupted one.

Steps per epoch: the returned dataset's `cardinality` is `steps_per_epoch`,
the number of global batches, in every configuration; Keras takes it as the
steps per epoch (progress bar, end of epoch). With a MirroredStrategy each
replica gets its own pipeline (`InputReplicationMode.PER_REPLICA`). A
MultiWorkerMirroredStrategy worker with several GPUs has one pipeline feeding
all of them, for which `tf.distribute` reports replicas x steps;
`tfdp.pipelines._upstream.set_global_steps` corrects that (otherwise the progress
bar is wrong and every epoch ends with "Your input ran out of data").
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

import tfdp
from tfdp import _checks
from tfdp.pipelines import _upstream
from tfdp.pipelines import input_pipeline as pipeline_lib
from tfdp.pipelines import sharding
from tfdp.pipelines import source_registry as sources_lib


def _batch_config(batch, global_batch, accum_steps, num_replicas: int) -> tfdp.BatchConfig:
    """The run's `BatchConfig`: `batch` as given, or built from `global_batch`."""
    if batch is None:
        if global_batch is None:
            raise ValueError(
                "Pass the batch: `batch=tfdp.BatchConfig(...)` (the object the training code "
                "gets too), or `global_batch=N`. Received neither."
            )
        return tfdp.BatchConfig.from_global(
            global_batch, num_replicas=num_replicas,
            accum_steps=1 if accum_steps is None else accum_steps)
    if not isinstance(batch, tfdp.BatchConfig):
        raise TypeError(
            f"`batch` must be a tfdp.BatchConfig (for a number, pass `global_batch`). "
            f"Received: batch={batch!r} of type {type(batch).__name__}"
        )
    if global_batch is not None or accum_steps is not None:
        raise ValueError(
            f"Pass `batch` alone: it already holds the global batch and accumulation "
            f"({batch.describe()}). Received also: global_batch={global_batch!r}, "
            f"accum_steps={accum_steps!r}"
        )
    if batch.num_replicas != num_replicas:
        raise ValueError(
            f"`batch` is for {batch.num_replicas} replica(s), but the strategy has "
            f"{num_replicas} replica(s) in sync. Build it for this strategy, e.g. "
            f"tfdp.BatchConfig.from_global({batch.global_batch}, "
            f"num_replicas=strategy.num_replicas_in_sync, accum_steps={batch.accum_steps}). "
            f"Received: batch={batch}"
        )
    return batch


def make_dataset(
    source,
    *,
    split: str = "train",
    strategy: tf.distribute.Strategy,
    batch: tfdp.BatchConfig | None = None,
    global_batch: int | None = None,
    accum_steps: int | None = None,
    training: bool = True,
    shuffle: bool = True,
    seed: int | None = None,
    data_dir: str | None = None,
    shard_policy: str = "auto",
    drop_remainder: bool | None = None,
    cache: bool | str = False,
    preprocess: Callable | None = None,
    distribute: bool = True,
):
    """Builds the input pipeline for `model.fit`/`evaluate` or a custom loop.

    Every replica gets its own slice of each global batch, every example is
    seen once per epoch across all workers, and every worker runs the same
    number of steps (see the module docstring for how).

    Args:
        source: a source name (`"digits"`, `"synthetic_images"`,
            `"synthetic_tokens"`, any TFDS name such as `"mnist"`), a
            `tf.data.Dataset` of unbatched `(features, label)` examples, a
            callable `input_context -> tf.data.Dataset` of them, or a
            `pipelines.Source`.
        split: the split of a named source, e.g. `"test"` or `"train[:90%]"`.
            Defaults to `"train"`.
        strategy: the `tf.distribute.Strategy` the dataset is for
            (`tf.distribute.get_strategy()` for none).
        batch: the batch arithmetic, a `tfdp.BatchConfig` whose
            `num_replicas` is the strategy's `num_replicas_in_sync`: the same
            object the training code (`tfdp.Trainer(batch=...)`, the learning
            rate scaling) gets, kept as `pipeline_info.batch`. Give either
            `batch` or `global_batch`.
        global_batch: the convenience form: examples per step, all replicas
            together, a multiple of `num_replicas_in_sync * accum_steps`;
            `make_dataset` builds the `BatchConfig` from it.
        accum_steps: with `global_batch`: micro-batches per replica per
            optimizer step (gradient accumulation is done by the training
            code). Defaults to 1. With `batch`, it is `batch.accum_steps`.
        training: training (shuffled, remainder dropped by default) or
            evaluation (in order, never dropped). Defaults to True.
        shuffle: shuffle examples (and files) every epoch; only when
            `training`. Defaults to True.
        seed: makes shuffling and random preprocessing reproducible (still
            different every epoch). Defaults to `None` (nondeterministic,
            slightly faster).
        data_dir: TFDS data directory for named sources. Defaults to TFDS's
            default, and for `"digits"` to `$TFDP_DATA_DIR` or
            `~/tensorflow_datasets` (generated there on first use).
        shard_policy: `"auto"` (default), `"file"`, `"data"` or `"off"`; see
            `tfdp.pipelines.sharding`.
        drop_remainder: drop the final partial global batch (training only:
            evaluation never drops). Defaults to `training`. When False, the
            last batches of an epoch are partial or empty (see the module
            docstring). When examples are dropped, their count is logged as a
            warning.
        cache: cache source examples after the first epoch: `True` in memory,
            or a file path prefix. Defaults to False.
        preprocess: callable `(features, label) -> (features, label)` applied
            per example in a parallel map (see `tfdp.pipelines.preprocess`).
        distribute: False plans the dataset without building it: returns a
            `PlannedDataset` (the same attributes; `distribute()` builds
            what `make_dataset` returns by default), for a caller that will
            iterate `epoch_stream` only. Defaults to True.

    Returns:
        A `tf.distribute.DistributedDataset` (a `tf.data.Dataset` under the
        default strategy) with attributes `pipeline_info` (a `pipelines.PipelineInfo`),
        `steps_per_epoch` and `num_examples`. Its `cardinality` is
        `steps_per_epoch` (infinite for an endless source). Also
        `start_at_batch(b)` (this epoch from global batch `b` on),
        `streams_epochs` and `epoch_stream(epoch, batch=0, *,
        steps_per_epoch=None, num_epochs=None)`: every epoch from `(epoch,
        batch)` on in one dataset, epoch `e` in an order that depends only
        on `seed` and `e` (training with a `seed` on a source that addresses
        its examples, `drop_remainder`); `tfdp.Trainer.train(dataset)` and
        `BackupAndRestore.wrap(dataset)` run a whole run on one iterator of it.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: neither or both of `batch` and `global_batch`, a `batch`
            for another replica count, unknown source name, missing
            `data_dir`, dataset not prepared, `global_batch` not divisible by
            replicas x `accum_steps`, a training split smaller than one global batch,
            examples that are not `(features, label)` tuples of statically
            shaped tensors, an invalid `shard_policy`, or `drop_remainder=True`
            with `training=False`.

    Example:

    >>> strategy = tfdp.make_strategy("mirrored", cpu_replicas=2)  # doctest: +SKIP
    >>> train = pipelines.make_dataset(                            # doctest: +SKIP
    ...     "digits", strategy=strategy, global_batch=64, seed=0,
    ...     preprocess=pipelines.normalize_images())
    >>> model.fit(train, epochs=5)                                  # doctest: +SKIP
    """
    if not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(
            "`strategy` must be a tf.distribute.Strategy (use "
            "tf.distribute.get_strategy() for the default one, or "
            f"tfdp.make_strategy()). Received: strategy={strategy!r}"
        )
    if not isinstance(split, str):
        raise TypeError(f"`split` must be a string. Received: split={split!r}")
    _checks.check_bool("training", training)
    _checks.check_bool("shuffle", shuffle)
    _checks.check_bool("distribute", distribute)
    if drop_remainder is not None:
        _checks.check_bool("drop_remainder", drop_remainder)
    if drop_remainder and not training:
        raise ValueError(
            "Evaluation never drops examples, but `drop_remainder=True` was passed "
            "with `training=False`: the final partial global batch would be left out "
            "of the metrics. Remove `drop_remainder` (evaluation keeps partial and "
            "empty batches, so its metrics equal single-device ones), or pass "
            "`training=True` if this dataset is for training. Received: "
            "training=False, drop_remainder=True"
        )
    if seed is not None:
        _checks.check_int("seed", seed, minimum=0)
    if shard_policy not in sharding.POLICIES:
        raise ValueError(
            f"`shard_policy` must be one of {', '.join(map(repr, sharding.POLICIES))}. "
            f"Received: shard_policy={shard_policy!r}"
        )
    if not isinstance(cache, (bool, str)) or cache == "":
        raise TypeError(
            "`cache` must be True/False or a non-empty file path prefix. "
            f"Received: cache={cache!r}"
        )
    if preprocess is not None and not callable(preprocess):
        raise TypeError(
            "`preprocess` must be a callable (features, label) -> (features, "
            f"label) or None. Received: preprocess={preprocess!r}"
        )
    batch = _batch_config(batch, global_batch, accum_steps, strategy.num_replicas_in_sync)
    resolved = sources_lib.get_source(source, split=split, data_dir=data_dir)
    resolved.check_split(split)
    pipeline = pipeline_lib.InputPipeline(
        source=resolved,
        split=split,
        batch=batch,
        training=training,
        shuffle=shuffle,
        seed=seed,
        shard_policy=shard_policy,
        drop_remainder=training if drop_remainder is None else drop_remainder,
        cache=cache,
        preprocess=preprocess,
    )
    options = None
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        # One pipeline per replica: each reads and preprocesses in parallel
        # with the others, and the cardinality is right without correction.
        options = tf.distribute.InputOptions(
            experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA
        )
    planned = PlannedDataset(pipeline, strategy, options)
    return planned.distribute() if distribute else planned


def _input_pipelines(strategy: tf.distribute.Strategy, options) -> int | None:
    """How many input pipelines `strategy.distribute_datasets_from_function`
    will build (`InputContext.num_input_pipelines`), without building them;
    None where this module cannot tell."""
    info = tfdp.strategy_info(strategy)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return info.num_workers  # one per worker (TF's CollectiveAllReduceExtended)
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        if info.num_workers != 1:
            return None
        per_replica = (options is not None and options.experimental_replication_mode
                       == tf.distribute.InputReplicationMode.PER_REPLICA)
        return len(info.devices) if per_replica else 1
    if strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        return 1  # the default strategy
    if isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return 1
    return None


class PlannedDataset:
    """`make_dataset(..., distribute=False)`: the dataset planned but not built.

    It has what the distributed dataset has except iteration:
    `pipeline_info`, `steps_per_epoch`, `num_examples`, `streams_epochs`
    and `epoch_stream(...)`. `distribute()` builds and returns the
    distributed dataset `make_dataset` returns by default. A run that will
    iterate `epoch_stream` only (`tfdp-train`, `BackupAndRestore.wrap`) so
    skips building epoch 0's pipelines, about 0.3-0.5 s per process.
    """

    def __init__(self, pipeline: pipeline_lib.InputPipeline, strategy, options):
        self._pipeline, self._strategy, self._options = pipeline, strategy, options
        num_pipelines = _input_pipelines(strategy, options)
        if num_pipelines is None:  # learn it from the strategy: build epoch 0 now
            self._built = _distribute(pipeline, strategy, options, start_batch=0)
            info = self._built.pipeline_info
        else:
            self._built = None
            info = pipeline.plan(num_pipelines, strategy.num_replicas_in_sync)[1]
        self.pipeline_info = info
        self.steps_per_epoch = info.steps_per_epoch
        self.num_examples = info.num_examples
        self.streams_epochs = pipeline.streams_epochs(
            info.num_input_pipelines, strategy.num_replicas_in_sync)

    def distribute(self):
        """The distributed dataset of epoch 0 (see `make_dataset`'s Returns), built once."""
        if self._built is None:
            self._built = _distribute(self._pipeline, self._strategy, self._options,
                                      start_batch=0)
        dataset = self._built
        if dataset.pipeline_info != self.pipeline_info:
            raise RuntimeError(  # _input_pipelines disagrees with this TensorFlow
                f"The input pipelines were planned as {self.pipeline_info.num_input_pipelines} "
                f"but {type(self._strategy).__name__} built "
                f"{dataset.pipeline_info.num_input_pipelines}. Please report this, with your "
                f"TensorFlow version; make_dataset(..., distribute=True) avoids it.")
        dataset.streams_epochs = self.streams_epochs
        dataset.epoch_stream = self.epoch_stream
        return dataset

    def epoch_stream(self, first_epoch: int, start_batch: int = 0, *,
                     steps_per_epoch: int | None = None, num_epochs: int | None = None):
        """Every epoch from `first_epoch` on (or `num_epochs` of them), entered at
        global batch `start_batch`, in one distributed dataset (only where
        `streams_epochs` is True).

        Epoch `e` is `steps_per_epoch` global batches (default: the
        dataset's) in an order that depends only on `seed` and `e`: what
        `tfdp.callbacks.BackupAndRestore.wrap(dataset)` iterates, one
        iterator for a whole `fit`.
        """
        _checks.check_int("first_epoch", first_epoch, minimum=0)
        _checks.check_int("start_batch", start_batch, minimum=0)
        _checks.check_int("steps_per_epoch", steps_per_epoch, minimum=1, allow_none=True)
        if not self.streams_epochs:
            raise ValueError(
                "This dataset cannot carry many epochs in one iterator: that needs "
                "training=True with a `seed`, drop_remainder, and a source that "
                "addresses its examples (not `cache`). Iterate it once per epoch instead."
            )
        stream = self._strategy.distribute_datasets_from_function(
            self._pipeline.epochs_at(first_epoch, start_batch, steps_per_epoch=steps_per_epoch,
                                     num_epochs=num_epochs), self._options)
        stream.pipeline_info = self.pipeline_info
        stream.steps_per_epoch = steps_per_epoch or self.steps_per_epoch
        stream.num_examples = self.num_examples
        return stream


def _distribute(pipeline: pipeline_lib.InputPipeline, strategy, options, *, start_batch: int):
    """The distributed dataset of `pipeline`'s epoch from global batch `start_batch` on,
    with `pipeline_info`, `steps_per_epoch`, `num_examples` and `start_at_batch`."""
    dataset = strategy.distribute_datasets_from_function(
        pipeline.at_batch(start_batch) if start_batch else pipeline, options)
    info = pipeline.last_info
    steps = info.steps_per_epoch
    _upstream.set_global_steps(dataset, None if steps is None else steps - start_batch)
    dataset.pipeline_info = info
    dataset.steps_per_epoch = steps
    dataset.num_examples = info.num_examples

    def start_at_batch(batch: int):
        """This epoch's dataset from global batch `batch` on (a resume), seeking
        instead of reading the batches before it (`tfdp.training.input_position`)."""
        _checks.check_int("batch", batch, minimum=0)
        if steps is not None and batch > steps - start_batch:
            raise ValueError(
                f"`batch` must be at most the {steps - start_batch} batches of this "
                f"dataset's epoch. Received: batch={batch}")
        return _distribute(pipeline, strategy, options, start_batch=start_batch + batch)

    dataset.start_at_batch = start_at_batch
    return dataset
