"""Keras 3's multi-step train and test functions, with the logs reduced once per execution.

With `steps_per_execution=N > 1`, Keras' TensorFlow trainer
(`TensorFlowTrainer._make_function`, keras/src/backend/tensorflow/trainer.py,
Keras 3.15) runs N steps in one `tf.function` call, but each step still
returns the metrics' results and reduces them across replicas
(`reduce_per_replica(..., "auto")`) inside the loop, and the loop carries
those logs: the reductions of N − 1 steps are computed and thrown away. On
one device that is a few small ops per step; under
MultiWorkerMirroredStrategy each log value becomes a cross-worker all-reduce
per step, a round trip of ≈2 ms on loopback for every metric, every step
(measured by `python -m tfdp.bench`, case "overhead", paths `keras_fit_n`
and `tfdp_fit`). `evaluate` (and `fit`'s validation) runs the same loop
over the test step, with the same cost per evaluation step.

`make_train_function` and `make_test_function` build the same loop (same
input handling: an `Optional` per step, stop at the end of the data,
`StopIteration` when an execution ran no step) whose steps return nothing,
and read the logs once, after the loop, from the metrics
(`model.get_metrics_result()` in replica context, reduced as Keras does).
For a step that returns `get_metrics_result()` — Keras' own train and test
steps and tfdp's — those are the very logs the last step would have
returned. The loop also traces in less time than Keras' (no `Optional` of
the logs, no `tf.cond` around each step). Models whose class overrides
`train_step` (or `test_step`) keep Keras' function for it (`applies_to`).

Private Keras members touched: `_make_function`, `_autoconvert_optionals`,
`steps_per_execution`, and `reduce_per_replica` of the trainer module.
`tests/_upstream/test_keras_train_function.py` checks that weights and
logged metrics match Keras' own functions, so a Keras change that breaks
this copy fails there first.

Version gate: outside `KNOWN_KERAS_RANGE`, `install` leaves Keras' own
functions in place (exact, only slower: a cross-replica reduction per metric
per step) and warns once, naming the version and the cost.
"""

from __future__ import annotations

import functools
import warnings

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as _keras_tf_trainer

from tfdp._upstream import _versions

# pylint: disable=protected-access

#: Keras (major, minor) versions this module was written against, inclusive.
KNOWN_KERAS_RANGE = ((3, 0), (3, 15))
_warned = False


def is_supported(keras_version: str | None = None) -> bool:
    """Whether `keras_version` (default: the installed one) is in `KNOWN_KERAS_RANGE`."""
    return _versions.keras_in_range(KNOWN_KERAS_RANGE, keras_version)


def _warn_unsupported_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    low, high = KNOWN_KERAS_RANGE
    warnings.warn(
        f"tfdp: Keras {keras.__version__} is outside the versions "
        f"tfdp/_upstream/keras_train_function.py was written for ({low[0]}.{low[1]} to "
        f"{high[0]}.{high[1]}), so model.fit and evaluate with steps_per_execution > 1 keep "
        f"Keras' own functions: exact, but each step reduces every logged metric across replicas "
        f"(one cross-worker all-reduce per metric per step on MultiWorkerMirroredStrategy). "
        f"Install keras<={high[0]}.{high[1]} to avoid that cost.",
        RuntimeWarning, stacklevel=3)


class StepBound:
    """An iterator handed to the train function with a cap on the steps it may take.

    `tfdp._upstream.keras_fit_resume` yields one for the last execution of an
    epoch that ends part-way through it, when one iterator carries every
    epoch: the execution must stop at the epoch's end, not run on into the
    next epoch's batches. Only tfdp's function takes it (`takes_step_bound`).
    `next()` reads one batch, as Keras' symbolic build does of what the
    epoch loop yields (not a tuple: Keras would take a tuple for a batch).

    Args:
        iterator: the distributed iterator.
        steps: the most steps the execution may take.
    """

    def __init__(self, iterator, steps: int):
        self.iterator = iterator
        self.steps = steps

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.iterator)


def takes_step_bound(model: keras.Model) -> bool:
    """Whether `model.fit`'s train function honours a `StepBound`: tfdp's is
    installed (`install`), so `make_train_function` builds it (or has)."""
    method = vars(model).get("make_train_function")
    return isinstance(method, functools.partial) and method.func is make_train_function


def evaluate_takes_step_bound(model: keras.Model) -> bool:
    """Whether `model.evaluate`'s test function honours a `StepBound` (tfdp's is installed)."""
    method = vars(model).get("make_test_function")
    return isinstance(method, functools.partial) and method.func is make_test_function


def applies_to(model: keras.Model, *, tfdp_step: bool = False, step: str = "train_step") -> bool:
    """Whether `model`'s `step` returns its metrics' results (so logs can wait).

    Args:
        model: a compiled Keras model.
        tfdp_step: an instance attribute `step` is tfdp's step (set by
            `tfdp.compile`), which returns them.
        step: `"train_step"` or `"test_step"`.

    Returns:
        True for tfdp's step, or for Keras' own step (the model's class does
        not override it and no other instance attribute replaces it).
    """
    if step in vars(model):
        return tfdp_step
    return getattr(type(model), step) is getattr(_keras_tf_trainer.TensorFlowTrainer, step)


def _make_function(model: keras.Model, step_function):
    """The multi-step function over `step_function` (see the module docstring)."""
    strategy = model.distribute_strategy
    steps_per_execution = model.steps_per_execution

    # Not converted by AutoGraph, as Keras' own function is not
    # (`do_not_convert` in `_make_function`): the loop below is written with
    # tf.while_loop / tf.cond, and the steps need no conversion. Converting
    # them re-parses the whole call tree of tfdp's step on the first trace
    # (≈10 s on the digits CNN, 2 workers; 1 s without).
    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        strategy.run(step_function, args=(data,))  # logs unused: read after the loop

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
        )
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator, max_steps):
        def cond(step, next_inputs):
            return tf.logical_and(step < max_steps, next_inputs.has_value())

        def body(step, next_inputs):
            one_step_on_data(next_inputs.get_value())
            next_inputs = tf.cond(
                step + 1 < max_steps,
                iterator.get_next_as_optional,
                lambda: next_inputs,
            )
            return step + 1, next_inputs

        steps_run, _ = tf.while_loop(
            cond, body, (tf.constant(0), iterator.get_next_as_optional())
        )
        with tf.control_dependencies([steps_run]):
            logs = strategy.run(model.get_metrics_result)
        return steps_run, _keras_tf_trainer.reduce_per_replica(logs, strategy, reduction="auto")

    if not model.run_eagerly:
        multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)
    keras_function = None

    def function(iterator):
        nonlocal keras_function
        max_steps = steps_per_execution
        if isinstance(iterator, StepBound):
            iterator, max_steps = iterator.iterator, min(iterator.steps, steps_per_execution)
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            # A tensor, so that a bounded execution does not trace again.
            steps_run, logs = multi_step_on_iterator(iterator, tf.constant(max_steps))
            if int(steps_run) == 0:
                raise StopIteration
            return logs
        # Python iterators (train_on_batch, test_on_batch): Keras' own per-step function.
        if keras_function is None:
            keras_function = model._make_function(step_function)
        return keras_function(iterator)

    return function


def make_train_function(model: keras.Model, force: bool = False):
    """`model.make_train_function` with one log reduction per execution.

    Install it with `model.make_train_function = functools.partial(
    make_train_function, model)` after `model.compile(steps_per_execution=N)`;
    Keras' `fit` then calls it as its own.

    Args:
        model: a compiled Keras model for which `applies_to` holds.
        force: rebuild even if a train function exists. Defaults to False.

    Returns:
        The train function (also stored as `model.train_function`): it takes
        an iterator, runs up to `steps_per_execution` steps, and returns the
        logs after the last one; `StopIteration` when the iterator is empty.
    """
    if model.train_function is not None and not force:
        return model.train_function
    model.train_function = _make_function(model, model.train_step)
    return model.train_function


def make_test_function(model: keras.Model, force: bool = False):
    """`model.make_test_function` with one log reduction per execution.

    As `make_train_function`, for `model.evaluate` and `fit`'s validation
    (`applies_to(model, step="test_step")` must hold).

    Returns:
        The test function (also stored as `model.test_function`).
    """
    if model.test_function is not None and not force:
        return model.test_function
    model.test_function = _make_function(model, model.test_step)
    return model.test_function


#: `keras.Model` method -> (the step it runs, tfdp's replacement).
_FUNCTIONS = {"make_train_function": ("train_step", make_train_function),
              "make_test_function": ("test_step", make_test_function)}


def install(model: keras.Model, *, tfdp_step: bool = False) -> bool:
    """Makes `model.fit` and `model.evaluate` use tfdp's functions where they apply.

    Args:
        model: a model just compiled (by `tfdp.compile`).
        tfdp_step: see `applies_to`.

    Returns:
        True if the train function was installed: `steps_per_execution > 1`,
        `applies_to(model)` and a Keras in `KNOWN_KERAS_RANGE` (else a
        warning, once). The test function is installed on the same terms,
        with `applies_to(model, step="test_step")`. Any earlier
        installation that no longer applies is removed.
    """
    installed = {}
    for method, (step, replacement) in _FUNCTIONS.items():
        wanted = model.steps_per_execution > 1 and applies_to(
            model, tfdp_step=tfdp_step, step=step)
        if wanted and not is_supported():
            _warn_unsupported_once()
            wanted = False
        if wanted:
            setattr(model, method, functools.partial(replacement, model))
        elif method in vars(model):
            delattr(model, method)
        installed[method] = wanted
    return installed["make_train_function"]
