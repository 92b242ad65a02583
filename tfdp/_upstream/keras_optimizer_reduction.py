"""Let a Keras 3 optimizer apply gradients that are already all-reduced.

Keras 3.15's TensorFlow optimizer all-reduces the gradients inside `apply`
(`TFOptimizer._backend_update_step` calls `_all_reduce_sum_gradients`, in
keras/src/backend/tensorflow/optimizer.py), just before it updates the
variables, and offers no way to see the reduced gradients or to pass in
gradients that are already reduced (tf-keras had
`apply_gradients(..., experimental_aggregate_gradients=False)`; Keras 3 dropped
it). `tfdp.training.nonfinite` needs both: it all-reduces the gradients itself, decides
from the *reduced* gradients whether the step is finite (the same sum on every
replica and worker, so the same decision, without a second collective), and
only then lets the optimizer apply them.

`gradients_already_reduced(optimizer)` turns the optimizer's own all-reduce
into the identity for the `apply` calls made inside it (at trace time: the
graph traced there has one all-reduce, tfdp's). It touches one private member,
`_all_reduce_sum_gradients`. `all_reduce_sum` is the same reduction Keras does
(one batched all-reduce of the non-`None` gradients).
`tests/training/test_nonfinite.py::test_one_all_reduce_per_step_and_the_same_update_as_keras`
counts the all-reduces at run time and compares the weights with Keras' own
`apply`: if Keras renames or stops using that member, the gradients are summed
twice and that test fails.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import keras
import tensorflow as tf

# pylint: disable=protected-access

_REDUCE_METHOD = "_all_reduce_sum_gradients"
_DEPTH = "_tfdp_reduced_gradients_depth"
_lock = threading.Lock()


def all_reduce_sum(
    context: tf.distribute.ReplicaContext, gradients: Sequence[tf.Tensor | None],
    options: tf.distribute.experimental.CommunicationOptions | None = None,
) -> list[tf.Tensor | None]:
    """Sums `gradients` over all replicas in one batched all-reduce, as Keras does.

    Args:
        context: the current replica context.
        gradients: one gradient (a tensor, `tf.IndexedSlices` or `None`) per
            variable.
        options: `tf.distribute.experimental.CommunicationOptions`, or `None`.

    Returns:
        The summed gradients, `None` where a gradient was `None`.
    """
    present = [g for g in gradients if g is not None]
    if not present:
        return list(gradients)
    reduced = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present, options=options))
    return [None if g is None else next(reduced) for g in gradients]


def _no_reduction(grads_and_vars):
    return list(grads_and_vars)


@contextlib.contextmanager
def gradients_already_reduced(optimizer) -> Iterator[None]:
    """Within the block, `optimizer.apply` does not all-reduce its gradients.

    Re-entrant and thread-safe: MirroredStrategy runs each replica's function
    in its own thread, and their blocks overlap.

    Args:
        optimizer: a Keras 3 optimizer on the TensorFlow backend.

    Raises:
        RuntimeError: the optimizer has no `_all_reduce_sum_gradients`: this
            Keras no longer reduces where tfdp expects it to.
    """
    if not callable(getattr(type(optimizer), _REDUCE_METHOD, None)):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no {_REDUCE_METHOD}: this Keras version "
            f"({keras.__version__}) all-reduces gradients elsewhere, so tfdp cannot "
            "apply already-reduced gradients. Train with nonfinite=None, or update "
            "tfdp/_upstream/keras_optimizer_reduction.py."
        )
    with _lock:
        depth = vars(optimizer).get(_DEPTH, 0)
        if depth == 0:
            object.__setattr__(optimizer, _REDUCE_METHOD, _no_reduction)
        object.__setattr__(optimizer, _DEPTH, depth + 1)
    try:
        yield
    finally:
        with _lock:
            depth = vars(optimizer)[_DEPTH] - 1
            object.__setattr__(optimizer, _DEPTH, depth)
            if depth == 0:
                object.__delattr__(optimizer, _REDUCE_METHOD)
