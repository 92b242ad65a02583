"""A Keras `LossScaleOptimizer` whose replicas agree on skipping a step.

Keras 3.15's `LossScaleOptimizer._tf_apply` (keras/src/optimizers/
loss_scale_optimizer.py, from keras-team/keras#18691) decides whether the
gradients are finite from the *first* replica's local, not yet all-reduced,
gradients ("Arbitrarily take `finite` from the first replica"). Under
MirroredStrategy an overflow on any other replica is therefore applied: the
all-reduced gradient is inf and every weight becomes inf/NaN. Under
MultiWorkerMirroredStrategy each worker decides from its own first replica,
so workers can disagree; one then waits alone in the gradient all-reduce.

`LossScaleOptimizer` here all-reduces the "some gradient is not finite" flag
over every replica and worker before Keras decides, so all replicas skip
(and halve the loss scale) or all apply, at one scalar all-reduce per step.
tfdp's training paths do not pay it: `tfdp.compile` and `tfdp.Trainer` train
under `mixed_float16` with `tfdp.training.nonfinite.NonFiniteLossScaleOptimizer`
(a subclass; in every `nonfinite` mode), which all-reduces the scaled
gradients itself, decides from their sums (the same on every replica) and
then unscales them, so its `apply` never reaches `check_finite`. This class
is for a Keras `LossScaleOptimizer` used directly under a strategy.
`tests/_upstream/test_loss_scale.py` shows the upstream optimizer still
applying an overflow from the second replica (so this can go when that test
fails) and this one skipping it on every replica.
"""

from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """`keras.optimizers.LossScaleOptimizer` with one skip decision for all replicas."""

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        not_finite = context.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
        )
        return tf.equal(not_finite, 0.0)

