"""Keeps Keras from building a distributed iterator it throws away after every pass.

Upstream (Keras 3.15, `keras/src/trainers/epoch_iterator.py`,
`EpochIterator._enumerate_iterator`): after a full pass over an input of
known length, the loop builds the next pass's iterator at once
(`self._current_iterator = iter(self._get_iterator())`). When
`steps_per_epoch` is None (every `evaluate`, `fit`'s validation, `fit`
without `steps_per_epoch`) that iterator is never used: the next pass
builds its own (evaluate's `reset()`, or the loop's "`steps_per_epoch is
None`" test at the start of the next epoch). On one device the waste is a
few milliseconds. Under a multi-replica strategy the iterator is a
`MultiDeviceIterator`, whose construction traces per-device functions and
whose teardown joins its threads: 35-40 ms per worker on a Zen 5 EPYC and
about 0.1 s on a 2-core Xeon VM (2026-11-28), once per evaluation.

Skipping it is exact only where building an iterator changes nothing
later: a reshuffling `shuffle` or a re-randomising `Dataset.random` draws a
seed from its seed generator whenever an iterator is built, so the spare
iterator moves the order of every later pass. `install()` therefore wraps
the loop, for the whole process, so that the spare iterator is skipped only
for an input that is distributed over more than one replica, has a known
length, and whose dataset graph holds no op that draws seeds or random
numbers (`may_draw_seeds`). Everywhere else, and if the graph cannot be
read, Keras' own loop runs unchanged.

One iterator for every validation pass of `fit`. Each validation pass
(`evaluate(_use_cached_eval_dataset=True)`, fit's cached
`_eval_epoch_iterator`) still builds a new distributed iterator, after
tearing the last one down. Under `MultiWorkerMirroredStrategy`, for an input
that qualifies as above, `keep_validation_iterator(model)` (called by
tfdp's `evaluate` when `fit` validates) makes every pass read one iterator
of the input repeated: each pass reads exactly its own batches, in its own
order, because an execution that would run past the pass's end gets a
`keras_train_function.StepBound` (so it needs tfdp's test function when a
call runs more than one step). Only there: under `MultiWorkerMirroredStrategy`
tfdp's `_maybe_symbolic_build` never reads a batch from the epoch iterator
outside a pass (`keras_multi_worker`), which a kept iterator needs; Keras'
own reads one per `evaluate` under `MirroredStrategy`.

`tests/_upstream/test_keras_spare_iterator.py` checks that Keras still
builds the spare iterator (the reason this module exists) and that skipping
it changes no result; `tests/training/test_multiworker_training.py` checks
that a kept validation iterator gives Keras' own validation logs on 2
workers.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from keras.src.trainers import epoch_iterator as _epoch_iterator
from keras.src.trainers.data_adapters import tf_dataset_adapter as _tf_dataset_adapter

from tfdp._upstream import _versions
from tfdp._upstream import keras_train_function as _keras_train_function

#: The Keras (major, minor) versions this module was written against.
KNOWN_KERAS_RANGE = ((3, 0), (3, 15))

#: Op types whose presence anywhere in a dataset's graph keeps Keras' loop:
#: substrings of the seed-drawing dataset ops (ShuffleDatasetV3,
#: ShuffleAndRepeatDatasetV2, RandomDatasetV2, the seed generators) and, to
#: stay on the safe side, of every random op a map function may hold.
SEED_OP_MARKERS = ("Shuffle", "Random", "Seed", "Sampl")

_PATCH_MARKER = "__tfdp_keras_spare_iterator_patch__"
_lock = threading.Lock()
#: Whether the installed wrapper skips anything (`uninstall` turns it off:
#: another wrapper may have wrapped it since, so it stays in the chain).
_active = False


def is_supported(keras_version: str | None = None) -> bool:
    """Whether `keras_version` (default: the installed one) is in `KNOWN_KERAS_RANGE`."""
    return _versions.keras_in_range(KNOWN_KERAS_RANGE, keras_version)


def may_draw_seeds(dataset) -> bool:
    """Whether building an iterator of `dataset` may change its later passes.

    True when its graph (functions included) holds an op named in
    `SEED_OP_MARKERS`, or when TensorFlow cannot serialise the graph: then
    nothing is assumed. (A `from_generator` input serialises; its generator
    runs at the first read, not when an iterator is built.)
    """
    from tensorflow.core.framework import graph_pb2

    try:
        serialized = dataset._as_serialized_graph()  # pylint: disable=protected-access
        graph = graph_pb2.GraphDef.FromString(serialized.numpy())
    except Exception:  # pylint: disable=broad-except
        return True
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
        ops.update(node.op for node in function.node_def)
    return any(marker in op for op in ops for marker in SEED_OP_MARKERS)


class _NoIterator:
    """Stands in for the spare iterator; the next pass replaces it before any read."""

    def __iter__(self):
        return self

    def __next__(self):
        raise RuntimeError(
            "tfdp skipped the iterator Keras builds at the end of a pass, and something read "
            "it: Keras' epoch loop has changed. Call "
            "tfdp._upstream.keras_spare_iterator.uninstall() and report it to tfdp.")


def _skips_spare(iterator) -> bool:
    """Whether this pass may end without building the next one (see the module docstring)."""
    if (not _active or iterator.steps_per_epoch is not None or not iterator._num_batches
            or not isinstance(iterator.data_adapter, _tf_dataset_adapter.TFDatasetAdapter)):
        return False
    strategy = getattr(iterator, "_distribute_strategy", None)
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return False
    verdict = getattr(iterator, "_tfdp_skips_spare", None)
    if verdict is None:
        dataset = iterator.data_adapter.get_tf_dataset()
        verdict = not may_draw_seeds(dataset)
        iterator._tfdp_skips_spare = verdict
    return verdict


def _without_spare(iterator, passes):
    """Keras' pass (`passes`), with `_get_iterator` stubbed for its closing rebuild only."""
    executions = len(range(0, iterator._num_batches, iterator.steps_per_execution))
    for _ in range(executions):
        try:
            yield next(passes)
        except StopIteration:
            return
    # The pass is done: what Keras builds now is the spare iterator.
    iterator._get_iterator = _NoIterator
    try:
        yield from passes
    finally:
        del iterator._get_iterator


def keep_validation_iterator(model) -> bool:
    """Makes `fit`'s validation passes share one distributed iterator (see above).

    Call it before each `evaluate(..., _use_cached_eval_dataset=True)`; it
    marks `model._eval_epoch_iterator` when that qualifies.

    Returns:
        True if the passes will share one iterator.
    """
    iterator = getattr(model, "_eval_epoch_iterator", None)
    strategy = getattr(iterator, "_distribute_strategy", None)
    if (iterator is None or strategy is None
            or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            or (iterator.steps_per_execution > 1
                and not _keras_train_function.evaluate_takes_step_bound(model))):
        return False
    if getattr(iterator, "_tfdp_keeps", None) is None:
        iterator._tfdp_keeps = (_skips_spare(iterator) and isinstance(
            iterator.data_adapter.get_tf_dataset(), tf.data.Dataset))
    return iterator._tfdp_keeps


def _kept_passes(iterator, passes):
    """Keras' pass (`passes`) over one kept iterator of the input repeated.

    A pass that stops early (a callback's `stop_evaluating`, an exception)
    leaves the kept iterator part-way through the input: it is dropped, and
    the next pass starts a new one at the input's beginning.
    """
    if "_get_iterator" not in vars(iterator):
        repeated = iterator.data_adapter.get_tf_dataset().repeat()
        kept = iter(iterator._distribute_strategy.experimental_distribute_dataset(repeated))
        iterator._get_iterator = lambda: kept
    step_size, total = iterator.steps_per_execution, iterator._num_batches
    read = 0
    try:
        for begin, end, distributed in passes:
            if step_size > 1 and begin + step_size > total:  # the pass ends inside this call
                distributed = _keras_train_function.StepBound(distributed, total - begin)
            yield begin, end, distributed
            read = min(begin + step_size, total)
    finally:
        if read < total:
            del iterator._get_iterator


def _make_enumerate_iterator(original):
    def _enumerate_iterator(self):
        passes = original(self)
        if getattr(self, "_tfdp_keeps", False) and _active:
            return _kept_passes(self, passes)
        return _without_spare(self, passes) if _skips_spare(self) else passes

    return _enumerate_iterator


def install() -> bool:
    """Wraps `EpochIterator._enumerate_iterator` once for the process (see above).

    Returns:
        True if the wrapper is in place and active; False on a Keras outside
        `KNOWN_KERAS_RANGE` (Keras' loop then runs as it is).
    """
    global _active
    if not is_supported():
        return False
    with _lock:
        current = _epoch_iterator.EpochIterator._enumerate_iterator
        if not _is_ours(current):
            replacement = _make_enumerate_iterator(current)
            setattr(replacement, _PATCH_MARKER, True)
            replacement.__wrapped__ = current
            _epoch_iterator.EpochIterator._enumerate_iterator = replacement
        _active = True
    return True


def _is_ours(function) -> bool:
    """Whether our wrapper is anywhere in `function`'s chain of `__wrapped__`."""
    while function is not None:
        if getattr(function, _PATCH_MARKER, False):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def uninstall() -> bool:
    """Makes the wrapper pass every pass through to Keras; True if it was active."""
    global _active
    with _lock:
        was, _active = _active, False
    return was
