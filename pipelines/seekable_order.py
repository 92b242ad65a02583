"""An epoch's example order that can be entered at any position.

This module owns the order in which one training input pipeline reads its
examples when the source can address them, either by index
(`Source.example_at`: in-memory and generated sources) or as raw records of
files whose record counts are known (`Source.record_files`: TFDS, your
TFRecord files). The order is a function of the position in the epoch, so a
resumed epoch (`make_dataset(...).start_at_batch(b)`) starts where the
uninterrupted one was, reading nothing before it. Batching, preprocessing and
the step count stay `tfdp.pipelines.input_pipeline`'s; which examples a
pipeline owns is decided in `tfdp.pipelines.sharding`.

The order of one epoch (one iteration of the dataset), for one pipeline:

1. The units (files; one unit for an indexed source) are put in a random
   order (`tf.random.experimental.index_shuffle`, keyed per iteration) and
   grouped into windows of `files_per_window` consecutive units, about
   `window_examples` examples each.
2. The windows are read one after the other. A window's raw records are read
   into memory (TFRecord bytes, not decoded; the next window is read while
   this one is consumed), and its examples are visited in a random
   permutation of the window (again `index_shuffle`, keyed per iteration and
   window). Only the visited records are parsed (decoded) and preprocessed.
   An indexed source has one window: a permutation of the whole split.
3. Element sharding (`"data"`: pipeline `i` of `n` keeps the examples at
   positions `i, i + n, ...` of the split) is applied to the positions before
   the permutation: every pipeline reads the same windows in the same order
   (the unit order is keyed by the run's seed, shared, or not shuffled
   without one) and permutes only the positions it owns, so the pipelines
   partition the split whatever their own keys.

Entering at stream position `s`: the windows before the one holding `s` are
never opened; in that window, the raw records are read (its files are
opened; TFDS instructions' leading records are skipped raw), the
permutation is evaluated from `s` on, and nothing before `s` is parsed.

The keys come from `tf.data.Dataset.random(seed, rerandomize_each_iteration=
True)`: the same on every build of the dataset with the same seed (a resumed
epoch is a fresh build of that epoch's dataset), new on every further
iteration of one dataset object (reshuffled each epoch), and random without
a seed. They depend on TensorFlow's global seed as any op-seeded random op
does (`tf.random.set_seed`, `keras.utils.set_random_seed`): set it alike in
the runs that must agree, or not at all.

`epoch_dataset(epoch, ...)` keys the same order by the epoch instead
(`tf.random.stateless_uniform` of the seed and `epoch`, whatever the global
seed): epoch `e` is the same in every build, so one dataset can carry many
epochs (`InputPipeline.build_epochs`, `make_dataset(...).epoch_stream`) and a
resume enters it at any `(epoch, position)`. It needs a seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import tensorflow as tf

from tfdp.pipelines.source import RecordFile


@dataclasses.dataclass(frozen=True)
class Residue:
    """Element sharding: the positions `index, index + count, ...` of the split."""

    index: int
    count: int


_plain = tf.autograph.experimental.do_not_convert  # graph functions without Python control flow


def _keys(seed: int | None, count: int, stream: int) -> tf.data.Dataset:
    """One element per iteration: `count` int64 keys, new on every iteration.

    `stream` tells apart key sets drawn from the same seed."""
    return tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1).map(
        _plain(lambda r: tf.random.stateless_uniform(
            [count], tf.stack([r, tf.constant(stream, tf.int64)]), minval=None, maxval=None,
            dtype=tf.int64)))


def _epoch_keys(seed: int, epoch: tf.Tensor, count: int, stream: int) -> tf.Tensor:
    """`count` int64 keys of `epoch` (a scalar int64 tensor): a function of
    `(seed, epoch, stream)` alone, the same in every build and every process."""
    return tf.random.stateless_uniform(
        [count], tf.stack([tf.constant(seed, tf.int64), epoch * _STREAMS + stream]),
        minval=None, maxval=None, dtype=tf.int64)


#: Key sets drawn per epoch (`stream` < this): unit keys and example keys.
_STREAMS = 4


def _owned_before(position: tf.Tensor, residue: Residue | None) -> tf.Tensor:
    """How many positions `< position` the residue owns (all of them without one)."""
    if residue is None:
        return position
    owned = (position - residue.index + residue.count - 1) // residue.count
    return tf.maximum(owned, 0)


class SeekableOrder:
    """The examples of one pipeline's epoch, in an order that can be entered anywhere.

    Give either `files` and `parse` (raw records of files with known counts)
    or `num_examples` and `example_at` (an indexed source).

    Args:
        files: the files this pipeline reads, in their natural order.
        parse: `serialized tf.string -> (features, label)`.
        num_examples: examples of an indexed source this pipeline reads
            from (the split's, for element sharding).
        example_at: `int64 index -> (features, label)`.
        residue: element sharding to apply, or `None` when the pipeline
            owns everything it reads.
        shuffle: permute units and examples; without it, the natural order.
        unit_seed: seed for the unit (file) order; with element sharding it
            must be the same in every pipeline (the run's seed). Ignored
            without `shuffle`; `None` with a residue keeps the natural file
            order (pipelines in several processes could not agree on a
            random one).
        example_seed: this pipeline's seed for the permutations in windows
            and for the preprocessing seeds.
        window_examples: about how many examples a window holds (at least
            one file). Defaults to 10,000.
    """

    def __init__(
        self,
        *,
        files: Sequence[RecordFile] | None = None,
        parse: Callable | None = None,
        num_examples: int | None = None,
        example_at: Callable | None = None,
        residue: Residue | None,
        shuffle: bool,
        unit_seed: int | None,
        example_seed: int | None,
        window_examples: int = 10_000,
    ):
        if (files is None) == (num_examples is None):
            raise ValueError("Give either `files` and `parse` or `num_examples` and `example_at`.")
        self._files = None if files is None else [f for f in files if f.take > 0]
        self._parse = parse
        self._example_at = example_at
        if self._files is not None:
            if not self._files:
                raise ValueError("`files` hold no record.")
            counts = [f.take for f in self._files]
            mean = sum(counts) / len(counts)
            self.files_per_window = max(1, min(len(counts), round(window_examples / max(mean, 1))))
        else:
            counts = [num_examples]
            self.files_per_window = 1
        self._counts = counts
        self._residue = residue
        self._shuffle = shuffle
        self._unit_seed = unit_seed
        self._example_seed = example_seed

    @property
    def num_examples(self) -> int:
        """Examples this pipeline reads per epoch (before any `take`)."""
        total = sum(self._counts)
        if self._residue is None:
            return total
        return len(range(self._residue.index, total, self._residue.count))

    # -- the plan of one iteration, in the graph -----------------------------

    def _windows(self, unit_key):
        """Per window: its units (padded with -1), its first split position, its size."""
        units = len(self._counts)
        per_window = self.files_per_window
        num_windows = math.ceil(units / per_window)
        order = tf.range(units, dtype=tf.int64)
        if self._shuffle and unit_key is not None and units > 1:
            order = tf.random.experimental.index_shuffle(order, unit_key, units - 1)
        counts = tf.gather(tf.constant(self._counts, tf.int64), order)
        pad = num_windows * per_window - units
        order = tf.reshape(tf.pad(order, [[0, pad]], constant_values=-1), [num_windows, per_window])
        sizes = tf.reduce_sum(tf.reshape(tf.pad(counts, [[0, pad]]), [num_windows, per_window]), 1)
        starts = tf.cumsum(sizes, exclusive=True)
        return order, starts, sizes

    def dataset(self, start: int, stop: int) -> tf.data.Dataset:
        """Stream positions `[start, stop)` of one epoch: `((features, label), seed)`.

        Args:
            start: the first position to produce (0 for a whole epoch).
            stop: one past the last position (the examples the epoch uses).

        Returns:
            An unbatched dataset; `seed` (int64 `[2]`) is the example's
            preprocessing seed: a key of the iteration and the example's
            position in this pipeline's epoch.
        """
        unit_seed, no_unit_key = self._unit_seed_of_order()
        unit_keys = _keys(unit_seed, 2, stream=1)
        example_keys = _keys(self._example_seed, 3, stream=2)
        keys = tf.data.Dataset.zip(unit_keys, example_keys)
        return keys.flat_map(self._iteration(start, stop, no_unit_key)).map(
            _plain(self._decode), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def epoch_dataset(self, epoch: tf.Tensor, start: tf.Tensor, stop: int) -> tf.data.Dataset:
        """Stream positions `[start, stop)` of epoch `epoch`, keyed by the epoch.

        As `dataset`, except that the keys are a function of the seeds and
        `epoch` (scalar int64 tensors `epoch` and `start` may come from an
        enclosing `flat_map`), not drawn anew per iteration: epoch `e` has
        the same order in every build, so one dataset can carry many epochs
        and a resumed one starts at any `(epoch, position)`. Needs
        `example_seed` (without one, call `dataset` per epoch).
        """
        if self._example_seed is None:
            raise ValueError("An epoch-keyed order needs a seed; without one, use `dataset`.")
        unit_seed, no_unit_key = self._unit_seed_of_order()
        epoch = tf.cast(epoch, tf.int64)
        keys = tf.data.Dataset.from_tensors((_epoch_keys(unit_seed, epoch, 2, stream=1),
                                             _epoch_keys(self._example_seed, epoch, 3, stream=2)))
        return keys.flat_map(self._iteration(start, stop, no_unit_key)).map(
            _plain(self._decode), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _unit_seed_of_order(self) -> tuple[int | None, bool]:
        """The seed of the unit order, and whether the natural order is kept instead."""
        shared_unit_key = self._residue is not None
        no_unit_key = shared_unit_key and self._unit_seed is None
        if no_unit_key:
            return 0, True
        return (self._unit_seed if shared_unit_key else self._example_seed), False

    def _iteration(self, start, stop: int, no_unit_key: bool):
        """`(unit_key, example_key) -> dataset` of one iteration's visited units."""
        residue = self._residue

        @_plain
        def iteration(unit_key, example_key):
            order, starts, sizes = self._windows(None if no_unit_key else unit_key)
            owned_start = _owned_before(starts, residue)
            owned = _owned_before(starts + sizes, residue) - owned_start
            ends = owned_start + owned
            first = tf.searchsorted(ends, tf.reshape(tf.convert_to_tensor(start, tf.int64), [1]),
                                    side="right", out_type=tf.int64)[0]
            windows = tf.data.Dataset.range(first, tf.size(ends, tf.int64)).filter(
                _plain(lambda w: tf.logical_and(owned[w] > 0, owned_start[w] < stop)))
            return windows.map(
                _plain(lambda w: self._window(w, order[w], starts[w], owned[w], owned_start[w],
                                              start, stop, example_key)),
                num_parallel_calls=1,  # the next window is read while this one is consumed
            ).prefetch(1).flat_map(_plain(self._window_examples))

        return iteration

    def _window(self, w, units, window_start, owned, owned_start, start, stop, example_key):
        """What one window needs: its raw records (files), and which of them to visit."""
        first = tf.maximum(tf.convert_to_tensor(start, tf.int64) - owned_start, 0)
        last = tf.minimum(tf.constant(stop, tf.int64) - owned_start, owned)
        seed = tf.stack([example_key[0] + w, example_key[1]])
        if self._files is None:
            records = tf.zeros([0], tf.string)
        else:
            units = tf.boolean_mask(units, units >= 0)
            paths = tf.gather(tf.constant([f.path for f in self._files]), units)
            skips = tf.gather(tf.constant([f.skip for f in self._files], tf.int64), units)
            takes = tf.gather(tf.constant([f.take for f in self._files], tf.int64), units)
            raw = tf.data.Dataset.from_tensor_slices((paths, skips, takes)).flat_map(_plain(
                lambda path, skip, take: tf.data.TFRecordDataset(path).skip(skip).take(take)))
            records = raw.batch(2**62).get_single_element()
        return records, window_start, owned, owned_start, first, last, seed, example_key[2]

    def _window_examples(self, records, window_start, owned, owned_start, first, last, seed,
                         preprocess_key):
        """The window's visited units (raw records, or indices), in order, with positions."""
        residue = self._residue
        q = tf.range(first, last, dtype=tf.int64)
        visited = q
        if self._shuffle:
            visited = tf.random.experimental.index_shuffle(q, seed, owned - 1)
        if residue is None:
            offsets = visited
        else:
            first_owned = (residue.index - window_start) % residue.count
            offsets = first_owned + visited * residue.count
        units = tf.gather(records, offsets) if self._files is not None else window_start + offsets
        keys = tf.fill(tf.shape(q), preprocess_key)
        return tf.data.Dataset.from_tensor_slices((units, owned_start + q, keys))

    def _decode(self, unit, position, preprocess_key):
        example = self._parse(unit) if self._files is not None else self._example_at(unit)
        return example, tf.stack([preprocess_key, position])
