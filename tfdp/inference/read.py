"""`tfdp.read_predictions`: a finished prediction run, in input order, checked.

Shards are contiguous ranges of input positions, so reading them in shard
order gives the input order. Every row's `id` is checked against its
position and the row count against the index: a missing, repeated or
misplaced example fails the read instead of passing silently.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tfdp.inference import shard_formats
from tfdp.inference.shard_layout import ShardLayout
from tfdp.inference.shard_store import ShardStore


def _tf_dtype(column: shard_formats.Column) -> tf.DType:
    return tf.string if column.dtype == "bytes" else tf.as_dtype(column.dtype)


def _checked_index(output_dir: str) -> dict:
    """The index of a complete run, after checking its shards are all there."""
    index = ShardStore(output_dir, "npz").read_index()
    if index is None:
        run = ShardStore(output_dir, "npz").read_run()
        if run is None:
            raise FileNotFoundError(
                f"{output_dir!r} holds no predictions (no index.json and no run.json). Pass the "
                f"output_dir given to tfdp.predict."
            )
        store = ShardStore(output_dir, run["output_format"])
        done = store.completed(ShardLayout(run["num_examples"], run["shard_size"]))
        total = -(-run["num_examples"] // run["shard_size"])
        raise ValueError(
            f"The predictions in {output_dir!r} are not complete: {len(done)} of {total} shards "
            f"are written. Rerun tfdp.predict (or tfdp-predict) with the same arguments to "
            f"score only the rest."
        )
    expected_first = 0
    for entry in index["shards"]:
        path = os.path.join(output_dir, entry["file"])
        if not os.path.isfile(path) or os.path.getsize(path) != entry["bytes"]:
            raise ValueError(
                f"Shard file {path!r} listed in the index is missing or was changed "
                f"(expected {entry['bytes']} bytes). Delete {output_dir!r}/index.json and "
                f"entries/{entry['shard']:05d}.json and rerun the same command to score it again."
            )
        if entry["first"] != expected_first:
            raise ValueError(
                f"The index of {output_dir!r} is inconsistent: shard {entry['shard']} starts at "
                f"position {entry['first']}, expected {expected_first}."
            )
        expected_first += entry["count"]
    if expected_first != index["num_examples"]:
        raise ValueError(
            f"The index of {output_dir!r} lists {expected_first} rows for "
            f"{index['num_examples']} examples."
        )
    return index


def _check_ids(dataset: tf.data.Dataset, num_examples: int) -> tf.data.Dataset:
    def check(position, row):
        with tf.control_dependencies([
            tf.debugging.assert_equal(
                row["id"], position,
                message="tfdp.read_predictions: a row's id is not its input position "
                        "(an example is missing, repeated or out of order)",
            )
        ]):
            return {name: tf.identity(value) for name, value in row.items()}

    checked = dataset.enumerate().map(check)
    return checked.apply(tf.data.experimental.assert_cardinality(num_examples))


def read_predictions(output_dir: str, *, as_numpy: bool = False):
    """The predictions `tfdp.predict` wrote to `output_dir`, in input order.

    Args:
        output_dir: the `output_dir` of a complete `tfdp.predict` run.
        as_numpy: return every column as one NumPy array (all of it in memory:
            for outputs that fit) instead of a `tf.data.Dataset`.

    Returns:
        A `tf.data.Dataset` of dicts, one per example in input order: `id`
        (int64 position), `key` if the run named one, and each model output
        (`predictions` for a single-output model). The dataset checks each
        row's `id` while it is read and fails on a missing or repeated one.
        With `as_numpy=True`, a dict of arrays with the same names.

    Raises:
        FileNotFoundError: `output_dir` holds no predictions.
        ValueError: the run is not complete (some shards are missing; rerun
            the same `tfdp.predict` call to finish it), or a shard file was
            changed or removed since it was written.
    """
    index = _checked_index(output_dir)
    output_format = index["output_format"]
    columns = {name: shard_formats.Column.from_json(c) for name, c in index["columns"].items()}
    paths = [os.path.join(output_dir, entry["file"]) for entry in index["shards"]]
    num_examples = index["num_examples"]
    if as_numpy:
        parts = list(shard_formats.iterate_shards(paths, output_format, columns))
        result = {name: np.concatenate([part[name] for part in parts]) for name in columns}
        if not np.array_equal(result["id"], np.arange(num_examples)):
            raise ValueError(
                f"The ids in {output_dir!r} are not 0..{num_examples - 1} in order: an example "
                f"is missing, repeated or out of order."
            )
        return result
    if output_format == "tfrecord":
        spec = shard_formats.feature_spec(columns)
        dataset = tf.data.TFRecordDataset(paths).map(
            lambda record: tf.io.parse_single_example(record, spec),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True,
        )
    else:
        signature = {
            name: tf.TensorSpec((None, *c.shape), _tf_dtype(c)) for name, c in columns.items()
        }
        dataset = tf.data.Dataset.from_generator(
            lambda: shard_formats.iterate_shards(paths, output_format, columns),
            output_signature=signature,
        ).unbatch()
    return _check_ids(dataset, num_examples)


__all__ = ["read_predictions"]
