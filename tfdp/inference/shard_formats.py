"""Prediction shard files: TFRecord, `.npz` and Parquet writers and readers.

A shard holds rows in input order. Each row has the column `id` (int64, the
example's position in the input), `key` when the caller names a key field,
and one column per model output (`predictions` for a model with one output,
else the output's name). A `ColumnSpec` (dtype and per-row shape of each
column) is recorded in the index, so readers never guess.

- `tfrecord`: one `tf.train.Example` per row; numbers flattened into
  `float_list` (float32) or `int64_list`, strings into `bytes_list`. Read
  back with `tf.io.parse_example` and `ColumnSpec.feature_spec()`.
- `npz`: one `numpy.savez` archive per shard, one array per column.
- `parquet`: needs `pyarrow`; one row group per written batch, each column
  flattened to a fixed-size list, its shape in the index.

This module does not decide file names or when a shard is complete:
that is `tfdp.inference.shard_store`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Iterator, Mapping

import numpy as np
import tensorflow as tf

FORMATS = ("tfrecord", "npz", "parquet")
EXTENSIONS = {"tfrecord": "tfrecord", "npz": "npz", "parquet": "parquet"}


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a prediction shard.

    Attributes:
        dtype: NumPy dtype name of the stored values, e.g. `"float32"`.
        shape: shape of one row's value, e.g. `[10]` for 10 logits.
    """

    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, value: Mapping) -> "Column":
        return cls(dtype=str(value["dtype"]), shape=tuple(int(d) for d in value["shape"]))


def stored_dtype(dtype: np.dtype) -> str:
    """The dtype a column of NumPy `dtype` is stored in (what every format can hold)."""
    if dtype.kind in "OSU":
        return "bytes"
    dtype = tf.as_dtype(dtype)
    if dtype.is_floating:
        return "float32" if dtype.size <= 4 else "float64"
    if dtype.is_integer or dtype.is_bool:
        return "int64"
    raise TypeError(
        f"Predictions of dtype {dtype.name} cannot be written; make the model "
        f"return float, integer, bool or string tensors."
    )


def column_of(value: np.ndarray) -> Column:
    """The `Column` of a batch `value` (rows along axis 0)."""
    return Column(stored_dtype(value.dtype), tuple(int(d) for d in value.shape[1:]))


def _as_stored(value, column: Column) -> np.ndarray:
    array = np.asarray(value)
    if column.dtype == "bytes":
        return array.astype(object)
    return array.astype(column.dtype, copy=False)


class ShardWriter(abc.ABC):
    """Writes one shard's rows, batch by batch, to `path`.

    Args:
        path: the file to write (a temporary name; the store renames it).
        columns: the `Column` of every column, in order.
    """

    def __init__(self, path: str, columns: Mapping[str, Column]):
        self.path = path
        self.columns = dict(columns)

    @abc.abstractmethod
    def write(self, batch: Mapping[str, np.ndarray]) -> None:
        """Appends a batch of rows: one array per column, rows along axis 0."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flushes and closes the file; after this it is complete on disk."""


def _proto_field(sizes, values, field: str, message: str) -> tf.Tensor:
    return tf.io.encode_proto(sizes, [values], [field], message)


@tf.function(reduce_retracing=True)
def _encode_examples(columns: dict) -> tf.Tensor:
    """Serialised `tf.train.Example`s, one per row of `columns` (name -> [rows, ...]).

    `tf.io.encode_proto` builds the messages in one op per level for the whole
    batch; building them one by one in Python (`tf.train.Example(...)`) costs
    about 330 us per row of 1,000 floats here, this about 20 us.
    """
    names = sorted(columns)
    rows = tf.shape(columns[names[0]])[0]
    ones = tf.ones([rows, 1], tf.int32)
    entries = []
    for name in names:
        value = columns[name]
        flat = tf.reshape(value, [rows, -1])
        count = tf.fill([rows, 1], tf.shape(flat)[1])
        if value.dtype == tf.string:
            inner, field, message = flat, "bytes_list", "tensorflow.BytesList"
        elif value.dtype.is_floating:
            inner, field, message = tf.cast(flat, tf.float32), "float_list", "tensorflow.FloatList"
        else:
            inner, field, message = tf.cast(flat, tf.int64), "int64_list", "tensorflow.Int64List"
        values = _proto_field(count, inner, "value", message)
        feature = _proto_field(ones, values[:, None], field, "tensorflow.Feature")
        entries.append(
            tf.io.encode_proto(
                tf.fill([rows, 2], 1), [tf.fill([rows, 1], name), feature[:, None]],
                ["key", "value"], "tensorflow.Features.FeatureEntry",
            )
        )
    features = _proto_field(
        tf.fill([rows, 1], len(names)), tf.stack(entries, axis=1), "feature", "tensorflow.Features"
    )
    return _proto_field(ones, features[:, None], "features", "tensorflow.Example")


class TFRecordShardWriter(ShardWriter):
    def __init__(self, path, columns):
        super().__init__(path, columns)
        self._writer = tf.io.TFRecordWriter(path)

    def write(self, batch):
        for column in self.columns:
            if self.columns[column].dtype == "float64":
                raise TypeError(
                    f"Column {column!r} is float64, which tf.train.Example stores only as "
                    f"float32; use output_format='npz' or 'parquet' to keep float64."
                )
        for record in _encode_examples({k: tf.constant(v) for k, v in batch.items()}).numpy():
            self._writer.write(record)

    def close(self):
        self._writer.close()


class NpzShardWriter(ShardWriter):
    def __init__(self, path, columns):
        super().__init__(path, columns)
        self._parts: dict[str, list[np.ndarray]] = {name: [] for name in self.columns}

    def write(self, batch):
        for name, column in self.columns.items():
            self._parts[name].append(_as_stored(batch[name], column))

    def close(self):
        arrays = {}
        for name, column in self.columns.items():
            parts = self._parts[name]
            arrays[name] = (
                np.concatenate(parts) if parts
                else np.zeros((0, *column.shape), object if column.dtype == "bytes" else column.dtype)
            )
        with open(self.path, "wb") as f:  # a file object: savez adds no ".npz"
            np.savez(f, **arrays)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            "output_format='parquet' needs pyarrow, which is not installed. Install it "
            "(pip install 'tfdp[parquet]' or pip install pyarrow), or use "
            "output_format='tfrecord' or 'npz'."
        ) from None
    return pyarrow, pyarrow.parquet


def check_format(output_format: str) -> None:
    """Raises `ValueError` for an unknown format or a missing optional package."""
    if output_format not in FORMATS:
        raise ValueError(
            f"`output_format` must be one of {', '.join(FORMATS)}. "
            f"Received: output_format={output_format!r}"
        )
    if output_format == "parquet":
        _pyarrow()


class ParquetShardWriter(ShardWriter):
    def __init__(self, path, columns):
        super().__init__(path, columns)
        self._pa, pq = _pyarrow()
        self._writer = pq.ParquetWriter(path, self._schema())

    def _type(self, column: Column):
        pa = self._pa
        scalar = pa.binary() if column.dtype == "bytes" else pa.from_numpy_dtype(np.dtype(column.dtype))
        return scalar if not column.shape else pa.list_(scalar, column.size)

    def _schema(self):
        return self._pa.schema([(name, self._type(c)) for name, c in self.columns.items()])

    def write(self, batch):
        pa = self._pa
        arrays = []
        for name, column in self.columns.items():
            values = _as_stored(batch[name], column)
            if column.shape:
                flat = pa.array(values.reshape(-1), type=self._type(column).value_type)
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, column.size))
            else:
                arrays.append(pa.array(values, type=self._type(column)))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self._schema()))

    def close(self):
        self._writer.close()


WRITERS = {"tfrecord": TFRecordShardWriter, "npz": NpzShardWriter, "parquet": ParquetShardWriter}


def feature_spec(columns: Mapping[str, Column]) -> dict:
    """`tf.io.parse_example` features for a TFRecord shard's columns."""
    spec = {}
    for name, column in columns.items():
        dtype = {"bytes": tf.string, "int64": tf.int64}.get(column.dtype, tf.float32)
        spec[name] = tf.io.FixedLenFeature(column.shape, dtype)
    return spec


def read_shard(path: str, output_format: str, columns: Mapping[str, Column]) -> dict[str, np.ndarray]:
    """One shard's columns as NumPy arrays, rows in stored order."""
    if output_format == "npz":
        with np.load(path, allow_pickle=any(c.dtype == "bytes" for c in columns.values())) as archive:
            return {name: archive[name] for name in columns}
    if output_format == "parquet":
        _, pq = _pyarrow()
        table = pq.read_table(path)
        result = {}
        for name, column in columns.items():
            values = table.column(name).combine_chunks()
            if column.shape:
                flat = values.flatten().to_numpy(zero_copy_only=False)
                result[name] = flat.reshape((-1, *column.shape)).astype(_numpy_dtype(column))
            else:
                result[name] = values.to_numpy(zero_copy_only=False).astype(_numpy_dtype(column))
        return result
    rows = [record.numpy() for record in tf.data.TFRecordDataset(path)]
    if not rows:
        return {name: np.zeros((0, *c.shape), _numpy_dtype(c)) for name, c in columns.items()}
    parsed = tf.io.parse_example(rows, feature_spec(columns))
    return {name: parsed[name].numpy() for name in columns}


def _numpy_dtype(column: Column):
    return object if column.dtype == "bytes" else np.dtype(column.dtype)


def iterate_shards(paths, output_format: str, columns: Mapping[str, Column]) -> Iterator[dict]:
    """Yields each shard's columns (NumPy), one shard in memory at a time."""
    for path in paths:
        yield read_shard(path, output_format, columns)
