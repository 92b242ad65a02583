"""`tfdp.predict`: score a dataset on every replica of every worker, into files.

This module owns the sequence of one worker's scoring: check the arguments,
record (or check) the run in `output_dir`, find the shards that are not
complete, read only this worker's examples, score them on all local replicas
and write each shard as soon as it is complete. Where the files go and what
makes them safe to resume is `tfdp.inference.shard_store`; the file formats
are `tfdp.inference.shard_formats`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
import weakref
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tfdp.distribute import strategy_info as strategy_info_lib
from tfdp.inference import shard_formats
from tfdp.inference.replica_forward import ReplicaForward
from tfdp.inference.replica_forward import local_replica_count
from tfdp.inference.replica_forward import split_for_replicas
from tfdp.inference.shard_layout import ShardLayout
from tfdp.inference.shard_layout import default_shard_size
from tfdp.inference.shard_store import OutputDirError
from tfdp.inference.shard_store import ShardStore

#: Examples per replica per step when `batch_size` is not given (Keras'
#: `predict` default of 32, per replica).
DEFAULT_PER_REPLICA_BATCH = 32

#: model -> {id(strategy): ReplicaForward}: a second call on the same model
#: reuses the traced function, as Keras' `predict` reuses `predict_function`.
_FORWARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: Column names tfdp writes itself; a model output may not use them.
RESERVED_COLUMNS = ("id", "key")


@dataclasses.dataclass(frozen=True)
class PredictionSummary:
    """What one worker's `tfdp.predict` call did.

    Attributes:
        output_dir: where the predictions are.
        num_examples: examples in the input (all workers).
        num_shards: output shards (all workers).
        complete: whether every shard is complete and `index.json` written.
        shards_found_complete: shards already complete when the call started
            (a resumed run skips them).
        shards_scored: shards this worker scored in this call.
        examples_scored: examples this worker scored in this call.
        seconds: wall time of this worker's scoring (input, model, writing).
        examples_per_second: `examples_scored / seconds` (0 if none).
    """

    output_dir: str
    num_examples: int
    num_shards: int
    complete: bool
    shards_found_complete: int
    shards_scored: int
    examples_scored: int
    seconds: float
    examples_per_second: float


def model_fingerprint(model: keras.Model, strategy: tf.distribute.Strategy) -> str:
    """SHA-256 (hex, 16 digits) of the model's weights: shapes, dtypes and values.

    Reads each variable's copy on this worker's first replica, so computing
    it runs no collective.
    """
    digest = hashlib.sha256()
    for weight in model.weights:
        variable = weight.value if isinstance(weight, keras.Variable) else weight
        local = strategy.experimental_local_results(variable)[0]
        value = np.asarray(local.numpy() if hasattr(local, "numpy") else local)
        digest.update(f"{value.dtype.str}{value.shape};".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:16]


def _count_examples(dataset: tf.data.Dataset) -> int:
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`source` is endless (infinite cardinality); predictions need a finite input. "
            "Pass a finite dataset, e.g. dataset.take(n)."
        )
    if cardinality != tf.data.UNKNOWN_CARDINALITY:
        return cardinality
    # One pass over the raw elements (before `preprocess`), in every worker;
    # counted in ragged batches, about 5x faster here than one by one.

    def rows(batch):
        leaf = tf.nest.flatten(batch)[0]
        if isinstance(leaf, tf.RaggedTensor):
            return leaf.nrows(out_type=tf.int64)
        return tf.shape(leaf, out_type=tf.int64)[0]

    return int(dataset.ragged_batch(4096).reduce(
        tf.constant(0, tf.int64), lambda count, batch: count + rows(batch)))


def _call_unpacked(fn: Callable, element):
    return fn(*element) if isinstance(element, tuple) else fn(element)


def _features_of(element):
    """The model input of an example: `x` of `(x, y[, sample_weight])`, as Keras unpacks it."""
    if isinstance(element, tuple):
        return keras.utils.unpack_x_y_sample_weight(element)[0]
    return element


def _split_key(features: dict, key: str):
    """`(features[key], the other features)`; a single other feature unwrapped."""
    rest = {name: value for name, value in features.items() if name != key}
    return features[key], (next(iter(rest.values())) if len(rest) == 1 else rest)


def _check_fits_model(model: keras.Model, features_spec) -> None:
    """Raises `ValueError` if the examples cannot be the model's input."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return  # a subclassed model declares no input; its first call will tell
    model_specs = tf.nest.flatten(inputs)
    given = tf.nest.flatten(features_spec)
    if len(model_specs) != len(given):
        raise ValueError(
            f"The model takes {len(model_specs)} input(s) but each example gives "
            f"{len(given)}: {features_spec}. Map the input to the model's inputs, e.g. "
            f"with `preprocess`."
        )
    for expected, spec in zip(model_specs, given):
        if spec.shape.rank is None:
            continue  # unknown until the first batch; the model's call will check
        expected_shape = tuple(expected.shape)[1:]
        shape = tuple(spec.shape)
        if len(shape) != len(expected_shape) or any(
            e is not None and d is not None and e != d for e, d in zip(expected_shape, shape)
        ):
            raise ValueError(
                f"Each example has shape {shape}, but the model expects "
                f"{expected_shape} (without the batch axis). Resize or reshape the input in "
                f"`preprocess`, or score it with the model it was made for."
            )


def _pad_batch(batch, size: int):
    """Pads every tensor of `batch` along axis 0 to `size` rows (zeros, or "" for strings)."""

    def pad(tensor):
        missing = size - tf.shape(tensor)[0]
        paddings = [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1)
        if tensor.dtype == tf.string:
            return tf.pad(tensor, paddings, constant_values="")
        return tf.pad(tensor, paddings)

    return tf.nest.map_structure(pad, batch)


def _named_outputs(model: keras.Model, outputs) -> dict[str, tf.Tensor]:
    if isinstance(outputs, dict):
        named = dict(outputs)
    elif isinstance(outputs, (list, tuple)):
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != len(outputs):
            names = [f"output_{i}" for i in range(len(outputs))]
        named = dict(zip(names, outputs))
    else:
        named = {"predictions": outputs}
    for name, value in named.items():
        if name in RESERVED_COLUMNS:
            raise ValueError(
                f"A model output is named {name!r}, which tfdp.predict uses for the example's "
                f"{'position' if name == 'id' else 'key'}. Rename the output."
            )
        if not isinstance(value, tf.Tensor):
            raise TypeError(f"Model output {name!r} is a {type(value).__name__}, not a tensor.")
    return named


class _ShardWriting:
    """Routes scored rows (in input order) to their shard files and commits each
    shard when its last row is written."""

    def __init__(self, store: ShardStore, layout: ShardLayout, worker: int, output_format: str):
        self.store, self.layout, self.worker = store, layout, worker
        self.writer_class = shard_formats.WRITERS[output_format]
        self.shard = None
        self.committed = 0

    def _open(self, shard: int, columns):
        self.scratch, self.name = self.store.start_shard(shard, self.worker)
        self.columns = columns
        self.writer = self.writer_class(self.scratch, columns)
        self.shard, self.written = shard, 0
        self.first, self.count = self.layout.bounds(shard)

    def write(self, positions: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        start = 0
        while start < len(positions):
            shard = self.layout.shard_of(int(positions[start]))
            if self.shard != shard:
                if self.shard is not None:
                    raise RuntimeError(
                        f"Shard {self.shard} ended after {self.written} of {self.count} rows; "
                        f"the input changed between passes (it must give the same examples in "
                        f"the same order every time it is read)."
                    )
                self._open(shard, {k: shard_formats.column_of(v) for k, v in columns.items()})
            end = int(np.searchsorted(positions, self.first + self.count, side="left"))
            self.writer.write({k: v[start:end] for k, v in columns.items()})
            self.written += end - start
            start = end
            if self.written == self.count:
                self.writer.close()
                self.store.commit_shard(
                    self.scratch, self.name, shard=shard, worker=self.worker,
                    first=self.first, count=self.count, columns=self.columns,
                )
                self.shard = None
                self.committed += 1

    def finish(self) -> None:
        if self.shard is not None:
            raise RuntimeError(
                f"The input ended in shard {self.shard} after {self.written} of {self.count} "
                f"rows; it must give the same number of examples every time it is read."
            )


def predict(
    model: keras.Model,
    source: tf.data.Dataset,
    *,
    output_dir: str,
    strategy: tf.distribute.Strategy | None = None,
    batch_size: int | None = None,
    output_format: str = "tfrecord",
    shard_size: int | None = None,
    key: str | None = None,
    preprocess: Callable | None = None,
    model_identity: dict[str, Any] | None = None,
    verbose: int = 1,
    log_every_seconds: float = 10.0,
    peer_timeout_seconds: float | None = None,
) -> PredictionSummary:
    """Scores every example of `source` once, data-parallel, into files in `output_dir`.

    Call it on every worker with the same arguments. Each worker scores its
    own output shards on all its local replicas and writes them itself;
    nothing is all-gathered and no collective runs. A rerun with the same
    arguments skips the shards already complete and scores the rest (a
    worker killed mid-shard loses only that shard). Read the result with
    `tfdp.read_predictions(output_dir)`.

        strategy = tfdp.make_strategy()
        with strategy.scope():
            model = keras.models.load_model("model.keras")
        tfdp.predict(model, dataset, output_dir="preds/", strategy=strategy)

    Args:
        model: a Keras model (created under `strategy.scope()` when a
            strategy is given); called with `training=False`.
        source: a finite `tf.data.Dataset` of unbatched examples, in the
            same order every time it is read: the model's input `x`, or
            `(x, y[, sample_weight])` tuples as Keras' `predict` takes (y and
            sample_weight are ignored). Example `i` gets id `i`. When its
            cardinality is unknown (after `filter`, `unbatch`, files), every
            worker counts it in one pass first: give it with
            `dataset.apply(tf.data.experimental.assert_cardinality(n))`.
        output_dir: directory for the shards and the index (a local or
            shared POSIX filesystem).
        strategy: the model's `tf.distribute.Strategy`. Defaults to the
            model's own (`model.distribute_strategy`).
        batch_size: examples per step over all replicas of all workers, as
            in Keras; must divide by the replica count. Defaults to 32 per
            replica.
        output_format: `"tfrecord"` (`tf.train.Example` per row), `"npz"` or
            `"parquet"` (needs `pyarrow`).
        shard_size: examples per output shard. Defaults to the size recorded
            in `output_dir` on a rerun, else about 4 shards per worker in
            whole per-worker batches, at most 65,536 examples.
        key: name of a feature (`x` must be a dict) that identifies each
            example; it is removed from the model input and written as the
            column `key` beside `id`.
        preprocess: applied to each example after this worker's examples
            are selected, so examples other workers score (or that a rerun
            skips) are never decoded; called like `Dataset.map`'s function.
        model_identity: extra JSON-serialisable facts recorded with the
            model's weight fingerprint (e.g. a checkpoint path).
        verbose: 1 prints progress lines on the chief, 0 prints nothing.
        log_every_seconds: seconds between progress lines.
        peer_timeout_seconds: how long the chief waits, after its own
            shards, for the other workers' shards before raising
            `TimeoutError`. Defaults to waiting as long as it takes.

    Returns:
        This worker's `PredictionSummary`. The chief's reports `complete`
        True once every shard is written.

    Raises:
        ValueError: bad arguments, an input that does not fit the model, or
            an `output_dir` that is unwritable or holds another run
            (`OutputDirError`); nothing in `output_dir` is changed.
        TypeError: `source` is not a `tf.data.Dataset`.
    """
    started = time.perf_counter()
    shard_formats.check_format(output_format)
    if not isinstance(source, tf.data.Dataset):
        raise TypeError(
            f"`source` must be a tf.data.Dataset of unbatched examples. Received: "
            f"{type(source).__name__}. Wrap arrays with tf.data.Dataset.from_tensor_slices."
        )
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    info = strategy_info_lib.strategy_info(strategy)
    replicas = info.num_replicas_in_sync
    local_replicas = local_replica_count(strategy)
    if batch_size is None:
        batch_size = DEFAULT_PER_REPLICA_BATCH * replicas
    if batch_size < 1 or batch_size % replicas:
        raise ValueError(
            f"`batch_size` must be a positive multiple of the {replicas} replica(s) in sync "
            f"(each replica scores an equal slice). Received: batch_size={batch_size}"
        )
    per_worker_batch = batch_size // replicas * local_replicas

    store = ShardStore(output_dir, output_format)
    store.check_writable()
    num_examples = _count_examples(source)
    recorded = store.read_run() or {}
    if shard_size is None:
        shard_size = recorded.get("shard_size") or default_shard_size(
            num_examples, num_workers=info.num_workers, per_worker_batch=per_worker_batch
        )
    layout = ShardLayout(num_examples, shard_size)

    element = source.element_spec
    if preprocess is not None:
        element = source.map(lambda *e: _call_unpacked(preprocess, e if len(e) > 1 else e[0])).element_spec
    features_spec = _features_of(element)
    if key is not None:
        if not isinstance(features_spec, dict) or key not in features_spec:
            raise ValueError(
                f"`key={key!r}` names no feature: each example's input is {features_spec}. "
                f"Give examples a dict input with a {key!r} entry, or leave `key` unset to "
                f"identify examples by position."
            )
        _, features_spec = _split_key(features_spec, key)
    _check_fits_model(model, features_spec)

    run = {
        "model": {"fingerprint": model_fingerprint(model, strategy), **(model_identity or {})},
        "num_examples": num_examples, "shard_size": shard_size,
        "output_format": output_format, "key": key,
    }
    store.claim(run)
    chief_talks = info.is_chief and verbose

    def summary(complete, found, scored, examples):
        seconds = time.perf_counter() - started
        return PredictionSummary(
            output_dir=output_dir, num_examples=num_examples, num_shards=layout.num_shards,
            complete=complete, shards_found_complete=found, shards_scored=scored,
            examples_scored=examples, seconds=seconds,
            examples_per_second=examples / seconds if examples and seconds else 0.0,
        )

    if store.read_index() is not None:
        if chief_talks:
            print(f"predict: {output_dir} already holds all {num_examples} predictions "
                  f"({layout.num_shards} shards); nothing to score.", flush=True)
        return summary(True, layout.num_shards, 0, 0)

    done = store.completed(layout)
    mine = layout.shards_of_worker(info.worker_index, info.num_workers, done)
    my_examples = sum(layout.bounds(s)[1] for s in mine)
    if chief_talks:
        print(
            f"predict: {num_examples} examples in {layout.num_shards} shards of {shard_size} "
            f"over {info.num_workers} worker(s), {replicas} replica(s), batch {batch_size} "
            f"({per_worker_batch} per worker); {len(done)} shard(s) already complete"
            f"{', resuming' if done else ''}.",
            flush=True,
        )

    writing = _ShardWriting(store, layout, info.worker_index, output_format)
    if mine:
        dataset = _worker_dataset(
            source, layout, mine, per_worker_batch=per_worker_batch, local_replicas=local_replicas,
            key=key, preprocess=preprocess,
        )
        forward = _FORWARDS.setdefault(model, {}).get(id(strategy))
        if forward is None or forward.strategy is not strategy:
            forward = _FORWARDS[model][id(strategy)] = ReplicaForward(model, strategy)
        scored = 0
        last_log = time.perf_counter()
        for positions, keys, valid, slices in dataset:
            outputs = _named_outputs(model, forward(slices))
            valid = int(valid)
            # Sliced in NumPy: an eager slice per column and batch costs more.
            columns = {"id": positions.numpy()[:valid]}
            if key is not None:
                columns["key"] = keys.numpy()[:valid]
            columns.update({name: value.numpy()[:valid] for name, value in outputs.items()})
            writing.write(columns["id"], columns)
            scored += valid
            now = time.perf_counter()
            if chief_talks and now - last_log >= log_every_seconds:
                last_log = now
                rate = scored / (now - started)
                print(
                    f"predict: {len(store.completed(layout))}/{layout.num_shards} shards complete; "
                    f"this worker {scored}/{my_examples} examples, {rate:,.0f} examples/s, "
                    f"ETA {(my_examples - scored) / rate:.0f} s",
                    flush=True,
                )
        writing.finish()
    else:
        scored = 0

    complete = store.write_index_if_complete(run, layout) is not None
    waited_from = time.perf_counter()
    last_log = waited_from
    while info.is_chief and not complete:
        time.sleep(0.5)
        complete = store.write_index_if_complete(run, layout) is not None
        now = time.perf_counter()
        missing = sorted(set(range(layout.num_shards)) - set(store.completed(layout)))
        if not complete and peer_timeout_seconds is not None and now - waited_from > peer_timeout_seconds:
            raise TimeoutError(
                f"After {peer_timeout_seconds:g} s the other workers have not completed shards "
                f"{missing[:10]}{'...' if len(missing) > 10 else ''}. Their own predictions "
                f"are kept: rerun the same command to score only what is missing."
            )
        if not complete and chief_talks and now - last_log >= log_every_seconds:
            last_log = now
            print(f"predict: waiting for {len(missing)} shard(s) of other workers.", flush=True)
    result = summary(complete, len(done), writing.committed, scored)
    if chief_talks:
        print(
            f"predict: {'all ' + str(num_examples) + ' predictions written' if complete else 'done'}"
            f" in {output_dir}; this worker scored {scored} examples in {writing.committed} "
            f"shard(s), {result.examples_per_second:,.0f} examples/s, {result.seconds:.1f} s.",
            flush=True,
        )
    return result


def _worker_dataset(
    source: tf.data.Dataset, layout: ShardLayout, shards: list[int], *, per_worker_batch: int,
    local_replicas: int, key: str | None, preprocess: Callable | None,
) -> tf.data.Dataset:
    """This worker's examples of `shards`, in input order, as padded batches:
    `(positions, keys, valid_rows, per-replica feature slices)`."""
    wanted = np.zeros(layout.num_shards, bool)
    wanted[shards] = True
    wanted = tf.constant(wanted)
    shard_size = tf.constant(layout.shard_size, tf.int64)

    def split(element):
        features = _features_of(element)
        example_key = tf.constant(0, tf.int64) if key is None else None
        if key is not None:
            example_key, features = _split_key(features, key)
        return example_key, features

    chunk = math.gcd(layout.shard_size, per_worker_batch)
    if preprocess is None and chunk == per_worker_batch:
        # Whole batches of raw examples, each inside one shard: other shards'
        # batches are dropped as they are read, with no per-example work.
        chunks = source.batch(chunk).enumerate().filter(
            lambda index, _: wanted[index * chunk // shard_size]
        )

        def prepare_batch(index, batch):
            rows = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
            positions = index * chunk + tf.range(rows)
            example_key, features = split(batch)
            if key is None:
                example_key = tf.zeros_like(positions)
            return positions, example_key, features

        dataset = chunks.map(prepare_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    else:
        # Example by example: only the raw elements of other shards are read;
        # `preprocess` runs on this worker's examples only.
        examples = source.enumerate().filter(lambda position, _: wanted[position // shard_size])

        def prepare(position, element):
            if preprocess is not None:
                element = _call_unpacked(preprocess, element)
            example_key, features = split(element)
            return position, example_key, features

        dataset = examples.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        dataset = dataset.batch(per_worker_batch, num_parallel_calls=tf.data.AUTOTUNE,
                                deterministic=True)

    def pad(positions, keys, features):
        valid = tf.shape(positions)[0]
        positions, keys, features = _pad_batch((positions, keys, features), per_worker_batch)
        return positions, keys, valid, split_for_replicas(features, local_replicas)

    dataset = dataset.map(pad, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.prefetch(tf.data.AUTOTUNE)


__all__ = ["OutputDirError", "PredictionSummary", "model_fingerprint", "predict"]
