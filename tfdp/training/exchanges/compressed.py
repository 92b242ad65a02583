"""The compressed exchange: a `tfdp.compression` compressor in place of the all-reduce.

Each replica hands the compressor (PowerSGD, Top-K;
`tfdp.distribute.compression`) one dense gradient per variable the wrapper
was built for, in that order (None where a variable got none this step: it
sends nothing, and its state stays as it was), divided by the loss scale first: its error-feedback memories hold gradients
of the unscaled loss, whatever the scale does later. It returns the
estimated sums, equal on every replica, and its new memories, which
`settle` commits only when the step is applied (a skipped step leaves them
as they were). Before the compressor's `start_step` the plain all-reduce
runs instead and the memories stay unchanged; every replica takes the same
branch (`iterations` is equal everywhere).

Per-replica state: the compressor's `state` (its error memories, PowerSGD's
warm-start Q), which cannot be re-cut for another number of replicas. With
one replica nothing is exchanged or compressed.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp._upstream import keras_optimizer_internals
from tfdp.distribute import compression
from tfdp.distribute import reduction
from tfdp.distribute import replica_cond
from tfdp.training.exchanges import base


class Compressed(base.Exchange):
    """Sums gradients through `compressor`, sending its values in `all_reduce_dtype`.

    Args:
        optimizer: the wrapper it exchanges for; read for the variables it
            was built for, `iterations` and `gradient_scale()`.
        compressor: a `tfdp.distribute.compression.GradientCompressor`.
        all_reduce_dtype: `None` or `"bfloat16"`: the dtype the compressor
            sends its floating-point values in.
    """

    state_repartitions = False

    def __init__(self, optimizer, compressor: compression.GradientCompressor,
                 all_reduce_dtype: str | None = None):
        super().__init__(optimizer)
        self.compressor = compressor
        self.all_reduce_dtype = all_reduce_dtype

    @property
    def state_variables(self) -> list:
        return list(self.compressor.state)

    @property
    def lost_by_keras_saves(self) -> str:
        return ("each replica's error-feedback memories of the gradient compressor "
                "(and PowerSGD's warm-start Q)")

    def build(self, variables: list) -> None:
        self.compressor.build(variables)

    def exchange(self, step: base.Step) -> base.Step:
        context = step.context
        if context.num_replicas_in_sync == 1:
            return step
        if step.divisor is not None:
            raise ValueError(
                "dividing_by_global cannot be used with a gradient compressor: its error "
                "memories must hold gradients already divided by the global count. Check "
                "optimizer.accepts_global_divisor (False here) and divide the loss first.")
        built = keras_optimizer_internals.built_variables(self.optimizer)
        given = {id(v): g for g, v in zip(step.gradients, step.variables)}
        scale = self.optimizer.gradient_scale()
        dense = []
        for variable in built:
            gradient = given.get(id(variable))
            if isinstance(gradient, tf.IndexedSlices):
                gradient = tf.convert_to_tensor(gradient)
            if gradient is not None and scale is not None:
                gradient = _divide(gradient, scale)
            dense.append(gradient)
        sums, new_state = self._sums(context, dense)
        by_variable = {id(v): s for v, s in zip(built, sums)}
        return step.replace(gradients=[by_variable[id(v)] for v in step.variables],
                            reduced=True, unscaled=True, pending=new_state)

    def _sums(self, context, dense: list):
        """`(estimated sums, new state)` of `dense` (None: no gradient), plain before `start_step`."""
        present = [g is not None for g in dense]

        def compressed(given):
            given = iter(given)
            sums, state = self.compressor.reduce(
                tf.distribute.get_replica_context(),
                [next(given) if p else None for p in present], self.all_reduce_dtype)
            return [s for s in sums if s is not None], state

        def plain(given):
            return (reduction.all_reduce_sum(tf.distribute.get_replica_context(), given,
                                             self.all_reduce_dtype),
                    [v.read_value() for v in self.compressor.state])

        # tf.cond takes no None: only the present gradients cross it.
        given = [g for g in dense if g is not None]
        start_step = getattr(self.compressor, "start_step", 0)
        sums, state = compressed(given) if not start_step else replica_cond.replica_cond(
            context, self.optimizer.iterations < start_step, plain, compressed, given)
        sums = iter(sums)
        return [next(sums) if p else None for p in present], state

    def settle(self, step: base.Step, proceed: tf.Tensor) -> base.Step:
        if step.pending is not None:
            # A skipped step leaves the error memories as they were.
            self.compressor.commit(step.pending, proceed)
        return step.replace(pending=None)


def _divide(gradient, scale):
    return gradient / tf.cast(scale, gradient.dtype)
