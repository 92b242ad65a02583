"""Makes Keras 3 `fit` / `evaluate` / `predict` work on MultiWorkerMirroredStrategy.

This module owns every patch tfdp applies so that the standard Keras workflow
(`with strategy.scope(): model.compile(...)`, then `model.fit(dataset)`) runs
on a `tf.distribute.MultiWorkerMirroredStrategy` (MWMS) with TensorFlow 2.21
and Keras 3.15 (the bugs were reported from TF 2.16 / Keras 3.x on). It does
not choose or build strategies: `tfdp.distribute.strategy` calls `apply()` whenever it
builds an MWMS. Patches 1 and 2 act only when the model's strategy is an MWMS.
Patch 3 fixes a TensorFlow bug that equally breaks `steps_per_execution > 1`
on an in-process MirroredStrategy whose all-reduce uses collectives
(TensorFlow's default over CPUs); it only changes call-time captures made in
`tf.cond` branches, which without it are never fed.

Upstream reports: keras-team/keras#20585 ("Does Keras 3 work with
`tf.distribute.MultiWorkerMirroredStrategy`?") and tensorflow/tensorflow#72388
(`Invalid reduction dimension 0 for input with 0 dimensions`). Three bugs,
each patched separately (`PATCHES`), each found with two worker processes on
127.0.0.1 (`tests/_upstream/test_keras_multi_worker.py` reproduces each one
with its patch removed):

1. `"symbolic_build_batch"` (Keras).
   Symptom: `fit` / `evaluate` fail before the first step with
   `ValueError: Attempt to convert a value (PerReplica:{...}) with an
   unsupported type ... to a Tensor.`
   Root cause: `TensorFlowTrainer._maybe_symbolic_build`
   (`keras/src/backend/tensorflow/trainer.py`) takes one distributed batch to
   learn the input shapes and "reduces" it with
   `strategy.reduce("MEAN", batch, axis=None)`, passing the whole `(x, y)`
   structure. `Strategy.reduce` does not accept nests (its own TODO says so);
   MirroredStrategy happens to map over them, MWMS's
   `CollectiveAllReduceExtended._reduce_to` does not and tries to convert the
   tuple of `PerReplica` values to one tensor.
   Patch: on MWMS, build from this worker's first local replica's batch
   (`strategy.experimental_local_results(v)[0]`); only shapes and dtypes are
   used, so no collective (and no mean of integer labels) is needed, and
   where the distributed dataset's `element_spec` already holds them (one
   replica per worker) no batch is read at all. When
   the model, its compiled loss and metrics and its optimizer are all built
   (every call after the first: each epoch's validation), `_symbolic_build`
   has nothing to do, so no batch is pulled at all: Keras would otherwise
   create a distributed iterator, read one batch and drop both, at every
   `evaluate()` (0.1-0.25 s per epoch on 2 workers, measured with
   `python -m tfdp.bench.time_to_accuracy`'s workload).

2. `"reduce_logs_mean"` (Keras).
   Symptom: the first `train_function` / `test_function` trace fails with
   `Invalid reduction dimension 0 for input with 0 dimensions` (#72388).
   Root cause: `reduce_per_replica(..., reduction="auto")` (same file), which
   combines the per-replica logs a step returns, has an MWMS branch that calls
   `strategy.reduce("MEAN", v, axis=0)`. `axis=0` reduces inside each
   replica's value along a batch axis; the logs are scalars, so there is none.
   On one worker the same function averages over replicas instead
   (`tf.reduce_mean(local_results, axis=0)`).
   Patch: on MWMS, `"auto"` / `"mean"` becomes
   `strategy.reduce("MEAN", v, axis=None)`: the mean over all replicas of all
   workers, the multi-worker twin of the single-worker behaviour. Every worker
   then logs the same values. Per-step logs are means of per-replica running
   metrics (exact when replicas see equally many examples, as on one worker);
   epoch-end logs and `evaluate()` results are read from the metric
   variables, which MWMS sums over all workers, so they are exact.

3. `"cond_call_time_captures"` (TensorFlow; triggered by the
   `steps_per_execution` loop of Keras' TensorFlow trainer).
   Symptom: `fit` / `evaluate` with `steps_per_execution > 1` fail at run time
   with `You must feed a value for placeholder tensor
   '.../while/cond/Placeholder_1' with dtype int32` (MWMS, and MirroredStrategy
   over CPUs). keras-team/keras#19246 (open) reports the same error for
   MirroredStrategy with a collective all-reduce inside the model.
   Root cause: MWMS collectives take their instance key as a *call-time*
   capture (`CollectiveReplicaLauncher._next_instance_key` ->
   `FuncGraph.capture_call_time_value`), fed when the outermost `tf.function`
   runs. Keras runs `steps_per_execution` steps in a `tf.while_loop` whose
   body calls the step (itself a `tf.function`) inside a `tf.cond`. Calling a
   function that has call-time captures re-creates them in the caller's
   graph; in a `tf.cond` branch that graph is a `CondBranchFuncGraph`, and
   `cond_v2` forwards only a branch's ordinary captures, not its call-time
   ones (`while_v2` forwards both), so the branch's placeholder is never fed.
   `_next_instance_key` already steps out of control-flow graphs for
   collectives built directly in a branch; nested function calls do not.
   Patch: `CondBranchFuncGraph.capture_call_time_value` registers the
   call-time capture in the enclosing (non-control-flow) function graph and
   captures that placeholder into the branch as an ordinary value, which
   `cond_v2` does forward.

`predict` needs no patch; for the record, Keras' MWMS path
(`_multi_worker_concat`) all-gathers each step's per-replica outputs, so on
every worker `predict` returns the predictions for the *global* input (the
data of all workers), ordered by step and, within a step, by worker. With
TensorFlow's default auto-sharding of an in-memory dataset (DATA: each global
batch is split across workers in order) this is exactly what a single process
returns for the same dataset.

Not changed, because it is Keras' single-worker semantics too: each replica's
loss is the mean over its own examples, so when a final partial batch splits
unevenly across replicas its gradient is a mean of per-replica means, not the
mean over the batch's examples. With global batches that divide evenly, N
workers train exactly like one device on the global batch (tested).

The patches are gated on the installed Keras version (`is_needed`): 3.0 up
to and including 3.15.*, the versions the bugs are known in. Outside that
range `apply()` does nothing and warns so once (`skipped_message`); the multi-worker tests then
run unpatched and fail if the bugs are still there, which tells us to widen
the range.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable, Iterable

import keras
import tensorflow as tf

from tfdp._upstream import _versions
from absl import logging
from keras.src.backend.tensorflow import trainer as _keras_tf_trainer
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_graphs
from tensorflow.python.util import nest as _nest

# pylint: disable=protected-access

#: Keras (major, minor) versions the bugs are known in, inclusive.
KNOWN_KERAS_RANGE = ((3, 0), (3, 15))

_PATCH_MARKER = "__tfdp_keras_multi_worker_patch__"


def _is_multi_worker(strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


# Patch 1: `TensorFlowTrainer._maybe_symbolic_build`.
def _local_batch_spec(epoch_iterator):
    """This worker's first replica's batch as `tf.TensorSpec`s, or None if unknown.

    `_symbolic_build` reads only the shapes and dtypes of the batch it is
    given; the distributed dataset's `element_spec` has them without an
    iterator (0.5-1 s on 2 workers to create one, read a batch and tear it
    down again, measured 2026-11-27). Each leaf of a distributed dataset's
    spec is a `PerReplicaSpec` (private: `values.PerReplicaSpec._value_specs`,
    one spec per local replica); anything else found there gives None, and
    the caller reads a batch.
    """
    get_dataset = getattr(epoch_iterator, "_get_iterator", None)  # TFEpochIterator's
    if get_dataset is None:
        return None
    try:
        spec = get_dataset().element_spec
    except (AttributeError, NotImplementedError, ValueError):
        return None

    def first_replica(leaf):
        leaf = getattr(leaf, "_value_specs", (leaf,))[0]
        return leaf if isinstance(leaf, tf.TensorSpec) else None

    local = tf.nest.map_structure(first_replica, spec)
    leaves = tf.nest.flatten(local)
    if not leaves or any(leaf is None for leaf in leaves):
        return None
    return local


def _first_local_batch(epoch_iterator, strategy):
    """This worker's first replica's part of the next batch, or None."""
    for _, _, batches in epoch_iterator:
        batch = next(batches)
        return keras.tree.map_structure(
            lambda v: (
                strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v
            ),
            batch,
        )
    return None


def _nothing_to_build(model) -> bool:
    """Whether Keras' `_symbolic_build` would build nothing (it checks the same four things)."""
    return (
        all(layer.built for layer in model._flatten_layers())
        and (model._compile_metrics is None or model._compile_metrics.built)
        and (model._compile_loss is None or model._compile_loss.built)
        and (model.optimizer is None or model.optimizer.built)
    )


def _make_maybe_symbolic_build(original: Callable) -> Callable:
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is not None and data_batch is None and _is_multi_worker(strategy):
            if _nothing_to_build(self):
                # Every evaluate() (each epoch's validation) and fit() call
                # lands here; pulling a batch would create a distributed
                # iterator only to throw it away (0.1-0.25 s on 2 workers).
                return None
            data_batch = _local_batch_spec(iterator)
            if data_batch is None:
                data_batch = _first_local_batch(iterator, strategy)
            iterator = None
        return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


# Patch 2: `reduce_per_replica` in keras/src/backend/tensorflow/trainer.py.
def _make_reduce_per_replica(original: Callable) -> Callable:
    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and _keras_tf_trainer._collective_all_reduce_multi_worker(
            strategy
        ):
            return keras.tree.map_structure(
                lambda v: None if v is None else strategy.reduce("MEAN", v, axis=None),
                values,
            )
        return original(values, strategy, reduction)

    return reduce_per_replica


# Patch 3: `CondBranchFuncGraph.capture_call_time_value` (TensorFlow).
def _make_cond_capture_call_time_value(original: Callable) -> Callable:
    def capture_call_time_value(
        self, closure, spec, key=None, default_value=None, placeholder=None
    ):
        if placeholder is not None:  # SavedModel loading: keep TF's behaviour.
            return original(
                self, closure, spec, key=key, default_value=default_value,
                placeholder=placeholder,
            )
        outer = self.outer_graph
        while getattr(outer, "is_control_flow_graph", False):
            outer = outer.outer_graph
        if not isinstance(outer, _func_graph.FuncGraph):  # TF1 graph: no call-time captures.
            return original(
                self, closure, spec, key=key, default_value=default_value
            )
        with outer.as_default():
            value = outer.capture_call_time_value(
                closure, spec, key=key, default_value=default_value
            )
        return _nest.map_structure(self.capture, value, expand_composites=True)

    return capture_call_time_value


@dataclasses.dataclass(frozen=True)
class _Patch:
    """One attribute replaced on a module or class."""

    name: str
    owner: Any
    attribute: str
    make: Callable[[Callable], Callable]


def _patches() -> tuple[_Patch, ...]:
    return (
        _Patch(
            "symbolic_build_batch",
            _keras_tf_trainer.TensorFlowTrainer,
            "_maybe_symbolic_build",
            _make_maybe_symbolic_build,
        ),
        _Patch(
            "reduce_logs_mean",
            _keras_tf_trainer,
            "reduce_per_replica",
            _make_reduce_per_replica,
        ),
        _Patch(
            "cond_call_time_captures",
            _cf_graphs.CondBranchFuncGraph,
            "capture_call_time_value",
            _make_cond_capture_call_time_value,
        ),
    )


#: Names of the patches, in the order they are applied.
PATCHES = tuple(patch.name for patch in _patches())

_lock = threading.Lock()
# name -> (owner had its own attribute, original value)
_originals: dict[str, tuple[bool, Any]] = {}
_skip_logged = False


def _check_patch_names(argument: str, names: Iterable[str] | None) -> tuple[str, ...]:
    if names is None:
        return PATCHES
    if isinstance(names, str):
        raise TypeError(
            f"`{argument}` must be an iterable of patch names, not a string. "
            f"Received: {argument}={names!r}. Pass e.g. {argument}=[{names!r}]."
        )
    names = tuple(names)
    unknown = [name for name in names if name not in PATCHES]
    if unknown:
        raise ValueError(
            f"`{argument}` must name patches among {', '.join(map(repr, PATCHES))}. "
            f"Received: {argument}={names!r} (unknown: {', '.join(map(repr, unknown))})."
        )
    return names


def is_needed(keras_version: str | None = None) -> bool:
    """Whether the installed Keras is one the patches are known to be needed for.

    Args:
        keras_version: a version string such as `"3.15.1"`. Defaults to
            `None`: the installed `keras.__version__`.

    Returns:
        True for Keras 3.0 up to and including 3.15.* (pre-releases and dev
        builds of those minor versions included), False otherwise.

    Raises:
        ValueError: `keras_version` does not start with `MAJOR.MINOR`.
    """
    return _versions.keras_in_range(KNOWN_KERAS_RANGE, keras_version)


def skipped_message() -> str:
    """What `apply()` says, once, when the installed Keras is outside `KNOWN_KERAS_RANGE`."""
    low, high = KNOWN_KERAS_RANGE
    return (
        f"tfdp: Keras {keras.__version__} is outside {low[0]}.{low[1]} to "
        f"{high[0]}.{high[1]}, the versions tfdp's MultiWorkerMirroredStrategy patches of "
        f"Keras' fit / evaluate / predict were written for, so they are not applied "
        f"(tfdp/_upstream/keras_multi_worker.py). If this Keras still has the bugs "
        f"(keras-team/keras#20585, tensorflow/tensorflow#72388, keras-team/keras#19246), "
        f"fit and evaluate fail before their first step ('unsupported type ... PerReplica', "
        f"'Invalid reduction dimension 0', or an unfed 'while/cond/Placeholder'). Then "
        f"train with tfdp.Trainer, which does not use Keras' fit loop, or install "
        f"keras<={high[0]}.{high[1]}."
    )


def _is_ours(value) -> bool:
    return bool(getattr(value, _PATCH_MARKER, False))


def apply(patches: Iterable[str] | None = None) -> bool:
    """Patches Keras / TensorFlow so `fit`, `evaluate`, `predict` work on MWMS.

    Idempotent: patches already in place are left alone. Call it before the
    model's `fit` / `evaluate` / `predict` first runs (`tfdp.make_strategy`
    calls it when it builds a MultiWorkerMirroredStrategy); train functions
    Keras has already traced keep the unpatched behaviour.

    Args:
        patches: names from `PATCHES` to apply. Defaults to `None`: all.
            (Applying a subset is for tests that show each one is needed.)

    Returns:
        True if this call patched anything; False if everything asked for was
        already patched, or the installed Keras is outside
        `KNOWN_KERAS_RANGE` (then it warns once, with a `RuntimeWarning`
        and an absl warning, naming the Keras version, the upstream issues
        and the alternatives).

    Raises:
        TypeError, ValueError: `patches` is not an iterable of names from
            `PATCHES`.
    """
    global _skip_logged
    names = _check_patch_names("patches", patches)
    if not is_needed():
        if not _skip_logged:
            _skip_logged = True
            message = skipped_message()
            logging.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False
    changed = []
    with _lock:
        for patch in _patches():
            if patch.name not in names:
                continue
            current = getattr(patch.owner, patch.attribute)
            if patch.name in _originals or _is_ours(current):
                continue
            replacement = patch.make(current)
            setattr(replacement, _PATCH_MARKER, True)
            replacement.__name__ = patch.attribute
            replacement.__wrapped__ = current
            had_own = patch.attribute in vars(patch.owner)
            _originals[patch.name] = (had_own, vars(patch.owner).get(patch.attribute))
            setattr(patch.owner, patch.attribute, replacement)
            changed.append(patch.name)
    if changed:
        logging.info(
            "tfdp: patched Keras %s / TensorFlow %s for MultiWorkerMirroredStrategy: %s.",
            keras.__version__, tf.__version__, ", ".join(changed),
        )
    return bool(changed)


def remove(patches: Iterable[str] | None = None) -> bool:
    """Restores the originals that `apply()` replaced.

    Args:
        patches: names from `PATCHES` to remove. Defaults to `None`: all.

    Returns:
        True if anything was restored.

    Raises:
        TypeError, ValueError: `patches` is not an iterable of names from
            `PATCHES`.
    """
    names = _check_patch_names("patches", patches)
    restored = False
    with _lock:
        for patch in _patches():
            if patch.name not in names or patch.name not in _originals:
                continue
            had_own, original = _originals.pop(patch.name)
            if had_own:
                setattr(patch.owner, patch.attribute, original)
            else:
                delattr(patch.owner, patch.attribute)
            restored = True
    return restored


def applied() -> tuple[str, ...]:
    """Names of the patches currently in place, in `PATCHES` order."""
    with _lock:
        return tuple(name for name in PATCHES if name in _originals)

