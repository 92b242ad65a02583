"""`tf.cond` between replica functions that hold collectives, under every strategy.

Under MirroredStrategy a collective (or a Keras optimizer update, which
`merge_call`s) inside a `tf.cond` in replica context fails: its `merge_call`
cannot sit in a nested graph (keras-team/keras#20582). `replica_cond` takes
the branch in cross-replica context instead and runs the chosen function on
every replica; where the strategy updates without `merge_call`
(MultiWorkerMirroredStrategy with one device per worker) it is a plain
`tf.cond`.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfdp._upstream import keras_optimizer_internals


def replica_cond(context: tf.distribute.ReplicaContext, predicate: tf.Tensor,
                 true_fn: Callable[[Any], Any], false_fn: Callable[[Any], Any], args: Any = ()):
    """`true_fn(args)` or `false_fn(args)` on every replica, chosen by `predicate`.

    Args:
        context: the current replica context.
        predicate: bool scalar, equal on every replica of this worker (the
            first replica's is used).
        true_fn, false_fn: functions of `args` run in replica context; each
            reads its own replica context. They must return the same
            structure.
        args: tensors (per replica) handed to the function.

    Returns:
        What the chosen function returned on this replica.
    """
    if keras_optimizer_internals.supports_no_merge_call():
        return tf.cond(predicate, lambda: true_fn(args), lambda: false_fn(args))

    def cross_replica(distribution, predicate, args):
        predicate = distribution.experimental_local_results(predicate)[0]
        return tf.cond(
            predicate,
            lambda: distribution.extended.call_for_each_replica(true_fn, args=(args,)),
            lambda: distribution.extended.call_for_each_replica(false_fn, args=(args,)),
        )

    # merge_call hands each replica its own part of the per-replica results.
    return context.merge_call(cross_replica, args=(predicate, args))
