"""One input pipeline's `tf.data` graph.

This module owns `InputPipeline`, the `dataset_fn` that
`strategy.distribute_datasets_from_function` calls with each input
pipeline's `tf.distribute.InputContext`; the record of what it delivers is
`tfdp.pipelines.pipeline_info.PipelineInfo`. The guarantees it implements
(exactly once per epoch, equal step counts everywhere, partial and empty
final batches instead of padding) are stated in `tfdp.pipelines.distributed_dataset`, which also
validates the user's arguments; which examples a pipeline reads is decided
in `tfdp.pipelines.sharding`.

A pipeline can be built entered at a global batch of its epoch (`build(...,
start_batch=b)`, what `make_dataset(...).start_at_batch(b)` distributes):
when training on a source that addresses its examples, its order is
`tfdp.pipelines.seekable_order`'s and nothing before the position is read
beyond raw records of the current window; otherwise `source.read` is skipped
before `preprocess`. Per-example random seeds (a `preprocess` with
`needs_seed`) depend on the position, so they are the same either way.
"""

from __future__ import annotations

import functools
from typing import Callable

import tensorflow as tf
from absl import logging

import tfdp
from tfdp import _checks
from tfdp.pipelines import sharding
from tfdp.pipelines.pipeline_info import PipelineInfo
from tfdp.pipelines import seekable_order
from tfdp.pipelines import source as source_lib

#: Largest shuffle buffer, in examples, per input pipeline.
SHUFFLE_BUFFER = 10_000

#: (source, split, global batch, dropped) already warned about in this process.
_DROP_WARNINGS_GIVEN: set = set()


def _empty_batch(spec: tf.TensorSpec) -> tf.Tensor:
    """A batch of 0 examples of `spec`."""
    shape = [0, *spec.shape.as_list()]
    if spec.dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, spec.dtype)


def _check_element_spec(spec, where: str, *, check_shapes: bool) -> None:
    """Raises unless examples are (features, label) of statically shaped tensors."""
    if not isinstance(spec, tuple) or len(spec) != 2:
        raise ValueError(
            f"Each example from {where!r} must be a (features, label) tuple "
            f"(unbatched). Received: element_spec={spec!r}. Map it into one, "
            f"e.g. dataset.map(lambda d: (d['image'], d['label']))."
        )
    if not check_shapes:
        return
    for leaf in tf.nest.flatten(spec):
        if not isinstance(leaf, tf.TensorSpec):
            raise ValueError(
                f"Examples from {where!r} must be dense tensors. "
                f"Received a {type(leaf).__name__} in element_spec={spec!r}. "
                f"Convert it in `preprocess` (e.g. pipelines.pad_tokens for "
                f"token sequences)."
            )
        if not leaf.shape.is_fully_defined():
            raise ValueError(
                f"Every tensor of an example must have a static shape to be "
                f"batched, but {where!r} gives element_spec="
                f"{spec!r}. Give them one in `preprocess`: "
                f"pipelines.pad_tokens(length=...) for token sequences, "
                f"pipelines.decode_image(shape=...) or tf.image.resize for "
                f"images, or tf.ensure_shape."
            )


def _prefetched_unsharded(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` prefetched on the host, marked so that tf.distribute does not
    shard it again (`InputPipeline` shards)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


class InputPipeline:
    """The `dataset_fn` of `distribute_datasets_from_function`: builds one
    input pipeline's dataset from an `input_context`.

    All pipelines (in this process and in every other worker) make the same
    plan from the same metadata, so they agree on `steps_per_epoch` without
    communicating. Arguments are as for `make_dataset`, with `source` a
    `pipelines.Source`, `batch` the run's `tfdp.BatchConfig` (kept as
    `PipelineInfo.batch`, not rebuilt) and `drop_remainder` resolved to a bool.
    """

    def __init__(
        self,
        *,
        source: source_lib.Source,
        split: str,
        batch: tfdp.BatchConfig,
        training: bool,
        shuffle: bool,
        seed: int | None,
        shard_policy: str,
        drop_remainder: bool,
        cache: bool | str,
        preprocess: Callable | None,
    ):
        self.source = source
        self.split = split
        self.batch = batch
        self.training = training
        self.shuffle = shuffle and training
        self.seed = seed
        self.shard_policy = shard_policy
        self.drop_remainder = drop_remainder
        self.cache = cache
        self.preprocess = preprocess
        # Order matters only when asked for (a seed) or for evaluation.
        self.deterministic = seed is not None or not training
        self._plans: dict[tuple[int, int], tuple[sharding.ShardPlan, PipelineInfo]] = {}
        self.last_info: PipelineInfo | None = None

    # -- planning ---------------------------------------------------------

    def _element_spec(self):
        dataset = self.source.read(self.split)
        _check_element_spec(dataset.element_spec, self.source.name, check_shapes=False)
        if self.preprocess is not None:
            seeds = tf.data.Dataset.random(seed=0).batch(2)
            dataset = self._apply_preprocess(tf.data.Dataset.zip((dataset, seeds)))
            _check_element_spec(dataset.element_spec, "preprocess", check_shapes=False)
        _check_element_spec(dataset.element_spec, self.source.name, check_shapes=True)
        return dataset.element_spec

    def plan(self, num_pipelines: int, num_replicas: int):
        """The shard plan and `PipelineInfo` for this many pipelines/replicas."""
        key = (num_pipelines, num_replicas)
        if key in self._plans:
            return self._plans[key]
        batch = self.batch
        if num_replicas != batch.num_replicas:
            raise ValueError(
                f"The input context has {num_replicas} replica(s) in sync, but the batch "
                f"is for {batch.num_replicas} ({batch.describe()}). Build the "
                f"BatchConfig for the strategy the dataset is distributed by."
            )
        per_replica = batch.replica_batch
        examples_per_step = batch.global_batch // num_pipelines
        element_spec = self._element_spec()
        total = self.source.num_examples(self.split)
        if total == 0:
            raise ValueError(f"Source {self.source.name!r} split {self.split!r} has no examples.")
        if total == source_lib.INFINITE and not self.training:
            raise ValueError(
                f"Evaluation needs a finite dataset, but source "
                f"{self.source.name!r} is endless. Pass a finite dataset, or "
                f"dataset.take(n)."
            )
        context_sizes = None
        if num_pipelines > 1 and self.shard_policy != "data":
            context_sizes = self.source.context_shard_sizes(self.split, num_pipelines)
        plan = sharding.plan_sharding(
            self.shard_policy,
            num_pipelines=num_pipelines,
            total=total,
            context_sizes=context_sizes,
            shards_by_file=self.source.shards_by_file,
            num_files=self.source.num_files(self.split),
            examples_per_step=examples_per_step,
            drop_remainder=self.drop_remainder,
            source_name=self.source.name,
        )
        steps = sharding.steps_per_epoch(
            plan.sizes, examples_per_step=examples_per_step, drop_remainder=self.drop_remainder
        )
        if steps == 0:
            raise ValueError(
                f"Source {self.source.name!r} split {self.split!r} has {total} "
                f"examples, fewer than one global batch of {batch.global_batch}"
                + (
                    f" (each of {num_pipelines} input pipelines needs "
                    f"{examples_per_step} but they get {list(plan.sizes)})"
                    if num_pipelines > 1
                    else ""
                )
                + ", so a training epoch would be empty. Lower `global_batch`, "
                "or pass drop_remainder=False to keep the partial batch."
            )
        seen = None if steps is None else sum(
            min(size, steps * examples_per_step) for size in plan.sizes
        )
        partial = 0 if steps is None or self.drop_remainder else sum(
            steps * (num_replicas // num_pipelines) - size // per_replica
            for size in plan.sizes
        )
        info = PipelineInfo(
            source=self.source.name,
            split=self.split,
            training=self.training,
            num_examples=total,
            num_classes=self.source.num_classes(),
            steps_per_epoch=steps,
            batch=batch,
            num_input_pipelines=num_pipelines,
            shard_mode=plan.mode,
            shard_reason=plan.reason,
            pipeline_sizes=plan.sizes,
            examples_per_epoch=seen,
            dropped_per_epoch=0 if seen is None else max(total - seen, 0),
            partial_batches_per_epoch=partial,
            element_spec=element_spec,
        )
        if plan.mode == "off" and num_pipelines > 1:
            logging.warning(
                "pipelines: shard_policy='off' with %d input pipelines: every "
                "example is seen %d times per epoch.",
                num_pipelines,
                num_pipelines,
            )
        self._plans[key] = (plan, info)
        return plan, info

    # -- building ---------------------------------------------------------

    def _apply_preprocess(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`preprocess` on `((features, label), seed)` elements, in a parallel map.

        A `preprocess` with `needs_seed` gets the element's stateless seed
        (int64 `[2]`); the seed is dropped either way.
        """
        fn = self.preprocess
        if fn is None:
            return dataset.map(lambda example, example_seed: example)
        if getattr(fn, "needs_seed", False):
            mapped = lambda example, example_seed: fn(*example, example_seed)  # noqa: E731
        else:
            mapped = lambda example, example_seed: fn(*example)  # noqa: E731
        return dataset.map(
            mapped, num_parallel_calls=tf.data.AUTOTUNE, deterministic=self.deterministic
        )

    @staticmethod
    def _empty_batches(dataset: tf.data.Dataset, count: int) -> tf.data.Dataset:
        """`count` batches of 0 examples with `dataset`'s element spec."""
        empty = tf.nest.map_structure(_empty_batch, dataset.element_spec)
        return tf.data.Dataset.from_tensors(empty).repeat(count)

    def __call__(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        return self.build(input_context)

    def at_batch(self, start_batch: int) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
        """The `dataset_fn` of the same epoch entered at global batch `start_batch`."""
        return functools.partial(self.build, start_batch=start_batch)

    def seekable(self, mode: str) -> bool:
        """Whether this pipeline reads through `tfdp.pipelines.seekable_order`.

        Training on a source that addresses its examples (by index, or as
        raw records of files with known counts), uncached, in a sharding mode
        that order implements. Everything else reads `source.read` and a
        resume passes the skipped examples through it (but not through
        `preprocess`).
        """
        if not self.training or self.cache or mode == "context":
            return False
        if self.source.example_at(self.split) is not None:
            return mode != "file"
        return self.source.record_files(self.split) is not None

    def _log_plan(self, info: PipelineInfo) -> None:
        logging.info("pipelines: %s", info.describe())
        warning_key = (info.source, info.split, info.global_batch, info.dropped_per_epoch)
        if info.dropped_per_epoch and warning_key not in _DROP_WARNINGS_GIVEN:
            # Once per process: a training loop rebuilds the dataset each epoch.
            _DROP_WARNINGS_GIVEN.add(warning_key)
            logging.warning(
                "pipelines: %s/%s: drop_remainder drops %d of %d examples every "
                "epoch (they do not fill a last global batch of %d across %d "
                "input pipeline(s)). Pass drop_remainder=False to train on them "
                "in partial batches, or pick a global batch that divides the "
                "split.",
                info.source, info.split, info.dropped_per_epoch, info.num_examples,
                info.global_batch, info.num_input_pipelines,
            )

    def _seekable_examples(self, plan, index: int, num_pipelines: int, start: int, stop: int,
                           seed: int | None) -> tf.data.Dataset:
        """`((features, label), preprocess seed)` from `seekable_order` (see `seekable`)."""
        residue = None
        if plan.mode == "data":
            residue = seekable_order.Residue(index, num_pipelines)
        return self._seekable_order(plan, index, num_pipelines, residue, seed).dataset(
            start, stop)

    def _seekable_order(self, plan, index: int, num_pipelines: int, residue, seed: int | None
                        ) -> seekable_order.SeekableOrder:
        """This pipeline's `SeekableOrder` (see `seekable`)."""
        common = dict(residue=residue, shuffle=self.shuffle, unit_seed=self.seed,
                      example_seed=seed, window_examples=SHUFFLE_BUFFER)
        example_at = self.source.example_at(self.split)
        if example_at is not None:
            return seekable_order.SeekableOrder(
                num_examples=self.source.num_examples(self.split), example_at=example_at,
                **common)
        files = self.source.record_files(self.split)
        if plan.mode == "file":
            files = files[index::num_pipelines]
        return seekable_order.SeekableOrder(
            files=files, parse=self.source.parse_record(self.split), **common)

    def _read_examples(self, plan, input_context, index: int, num_pipelines: int, size: int,
                       start: int, stop: int, seed: int | None) -> tf.data.Dataset:
        """`((features, label), preprocess seed)` from `source.read`, entered at `start`.

        The examples before `start` are read (and decoded, by the source)
        and pass the shuffle buffer, but are not preprocessed.
        """
        dataset = self.source.read(
            self.split,
            input_context=input_context if plan.reads_with_context else None,
            # Element sharding needs one read order in every process.
            shuffle_files=self.shuffle and plan.mode != "data",
            seed=seed,
        )
        if plan.mode == "data":
            dataset = dataset.shard(num_pipelines, index)
        if self.cache:
            dataset = dataset.cache(
                "" if self.cache is True
                else f"{self.cache}-{self.split}-{index}-of-{num_pipelines}"
            )
        if self.shuffle:
            buffer = SHUFFLE_BUFFER if size == source_lib.INFINITE else min(size, SHUFFLE_BUFFER)
            dataset = dataset.shuffle(max(buffer, 1), seed=seed, reshuffle_each_iteration=True)
        if stop != source_lib.INFINITE:
            dataset = dataset.take(stop)
        # One stateless seed per example: reproducible under a parallel map,
        # and new every epoch.
        seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)
        dataset = tf.data.Dataset.zip((dataset, seeds))
        return dataset.skip(start) if start else dataset

    def streams_epochs(self, num_pipelines: int, num_replicas: int) -> bool:
        """Whether `build_epochs` can carry many epochs in one dataset here.

        It needs the seekable order (`seekable`) keyed by a `seed`, and whole
        global batches (`drop_remainder`, a finite epoch)."""
        plan, info = self.plan(num_pipelines, num_replicas)
        return (self.seekable(plan.mode) and self.seed is not None and self.drop_remainder
                and info.steps_per_epoch is not None)

    def epochs_at(self, first_epoch: int, start_batch: int = 0, *,
                  steps_per_epoch: int | None = None, num_epochs: int | None = None
                  ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
        """The `dataset_fn` of the epochs from `(first_epoch, start_batch)` on, in one
        dataset (`build_epochs`)."""
        return functools.partial(self.build_epochs, first_epoch=first_epoch,
                                 start_batch=start_batch, steps_per_epoch=steps_per_epoch,
                                 num_epochs=num_epochs)

    def build_epochs(self, input_context: tf.distribute.InputContext, *, first_epoch: int,
                     start_batch: int = 0, steps_per_epoch: int | None = None,
                     num_epochs: int | None = None) -> tf.data.Dataset:
        """One input pipeline's batches of epochs `first_epoch, first_epoch + 1, ...`,
        entered at global batch `start_batch` of the first, in one dataset: endless,
        or `num_epochs` epochs.

        Each epoch is `steps_per_epoch` global batches (default: all the
        split holds; fewer take the first ones of each epoch's order, this
        pipeline's share of them) in the order `seekable_order.SeekableOrder.epoch_dataset`
        gives epoch `e`: a function of the seed and `e`, so a run resumed at
        `(e, b)` continues with exactly the batches of the uninterrupted one,
        and one iterator serves a whole `fit` (no per-epoch pipeline build,
        iterator, or iterator teardown). Every epoch's batch count is still
        asserted. Only where `streams_epochs` holds.
        """
        num_pipelines = input_context.num_input_pipelines
        index = input_context.input_pipeline_id
        num_replicas = input_context.num_replicas_in_sync
        if not self.streams_epochs(num_pipelines, num_replicas):
            raise ValueError(
                f"{self.source.name}/{self.split}: one dataset can carry many epochs only "
                f"for training with a seed, drop_remainder and a source that addresses its "
                f"examples, uncached and not sharded by input context. Build one dataset "
                f"per epoch instead.")
        plan, info = self.plan(num_pipelines, num_replicas)
        self.last_info = info
        if index == 0 and not (first_epoch or start_batch):
            self._log_plan(info)
        steps = info.steps_per_epoch
        if steps_per_epoch is not None:
            if not 0 < steps_per_epoch <= steps:
                raise ValueError(
                    f"`steps_per_epoch` must be in [1, {steps}] (the global batches the "
                    f"split holds). Received: steps_per_epoch={steps_per_epoch}")
            steps = steps_per_epoch
        _checks.check_int("first_epoch", first_epoch, minimum=0)
        if not 0 <= start_batch <= steps:
            raise ValueError(
                f"`start_batch` must be in [0, {steps}] (the steps of an epoch). "
                f"Received: start_batch={start_batch}")
        per_replica = self.batch.replica_batch
        replicas_fed = num_replicas // num_pipelines
        examples_per_step = per_replica * replicas_fed
        seed = self.seed + 1_000_003 * index
        stop = steps * examples_per_step
        residue = seekable_order.Residue(index, num_pipelines) if plan.mode == "data" else None
        order = self._seekable_order(plan, index, num_pipelines, residue, seed)
        first_start = start_batch * examples_per_step

        # Graph ops only (no Python control flow on tensors): not converted by
        # autograph, which took 1-3 s of every build of the stream (its
        # functions and theirs transformed from source).
        @tf.autograph.experimental.do_not_convert
        def one_epoch(epoch):
            start = tf.where(epoch == first_epoch, tf.constant(first_start, tf.int64),
                             tf.constant(0, tf.int64))
            # A miscount (a source whose metadata lies) fails at that epoch's
            # end instead of shifting every later epoch.
            return order.epoch_dataset(epoch, start, stop).apply(
                tf.data.experimental.assert_cardinality(stop - start))

        _checks.check_int("num_epochs", num_epochs, allow_none=True)
        last = 2**62 if num_epochs is None else first_epoch + num_epochs
        examples = tf.data.Dataset.range(first_epoch, last).flat_map(one_epoch)
        # Preprocessed and batched outside the epochs' `flat_map`: `preprocess`
        # is converted by autograph as in every other map (inside a function
        # that is not, it would not be), and no batch spans two epochs, since
        # every epoch holds whole batches (`stop` and `first_start` are
        # multiples of `per_replica`).
        batches = self._apply_preprocess(examples).batch(
            per_replica, drop_remainder=True, num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=self.deterministic)
        return _prefetched_unsharded(batches)  # see `build`

    def build(self, input_context: tf.distribute.InputContext, start_batch: int = 0
              ) -> tf.data.Dataset:
        """One input pipeline's dataset, entered at global batch `start_batch` of the epoch.

        Entered part-way, it yields exactly the batches the whole epoch's
        dataset yields from that step on (the same seeds, the same order).
        """
        num_pipelines = input_context.num_input_pipelines
        index = input_context.input_pipeline_id
        num_replicas = input_context.num_replicas_in_sync
        plan, info = self.plan(num_pipelines, num_replicas)
        self.last_info = info
        if index == 0 and not start_batch:  # Once per dataset build, on the first worker only.
            self._log_plan(info)
        per_replica = self.batch.replica_batch  # plan() checked the replica count
        replicas_fed = num_replicas // num_pipelines
        examples_per_step = per_replica * replicas_fed
        size = plan.sizes[index]
        steps = info.steps_per_epoch
        if steps is not None and not 0 <= start_batch <= steps:
            raise ValueError(
                f"`start_batch` must be in [0, {steps}] (the steps of an epoch). "
                f"Received: start_batch={start_batch}")
        # Seeds differ per pipeline so pipelines do not shuffle in lockstep.
        seed = None if self.seed is None else self.seed + 1_000_003 * index
        if steps is not None and self.drop_remainder:
            stop = steps * examples_per_step
        else:
            stop = size
        start = start_batch * examples_per_step
        if stop != source_lib.INFINITE:
            start = min(start, stop)

        if self.seekable(plan.mode):
            dataset = self._seekable_examples(plan, index, num_pipelines, start, stop, seed)
        else:
            dataset = self._read_examples(plan, input_context, index, num_pipelines, size,
                                          start, stop, seed)
        dataset = self._apply_preprocess(dataset)
        unbatched = dataset
        dataset = dataset.batch(
            per_replica,
            drop_remainder=self.drop_remainder or steps is None,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=self.deterministic,
        )
        if steps is not None and not self.drop_remainder:
            batches = -(-(stop - start) // per_replica)
            dataset = dataset.concatenate(
                self._empty_batches(unbatched, (steps - start_batch) * replicas_fed - batches)
            )
        if steps is not None:
            # Turns a miscount (a source whose metadata lies) into an error at
            # the end of the epoch instead of a hang in a collective.
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(
                (steps - start_batch) * replicas_fed))
        # Prefetch on the host. Under MirroredStrategy, OneDeviceStrategy and
        # MultiWorkerMirroredStrategy, tf.distribute's iterator then copies
        # each replica's batch to its device ahead of the step (a
        # MultiDeviceIterator whenever InputOptions.experimental_fetch_to_device,
        # True by default: `_should_use_multi_device_iterator` in
        # tensorflow/python/distribute/input_lib.py). Under the default
        # strategy on a GPU nothing does, but tf.data.experimental.
        # prefetch_to_device does not fit model.fit: it must be the last
        # transformation and makes the cardinality unknown, so Keras no longer
        # knows the steps per epoch and warns "Your input ran out of data"
        # every epoch (tests/pipelines/test_upstream.py). For one GPU, use
        # tf.distribute.OneDeviceStrategy("/gpu:0") (tfdp.make_strategy(
        # "one_device")) to get the device prefetch.
        return _prefetched_unsharded(dataset)
