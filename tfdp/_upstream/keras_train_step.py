"""The forward-and-loss part of Keras 3's TensorFlow `train_step`, reusable.

`tfdp.training.accumulation` runs Keras' train step once per micro-batch but must own
the gradient and optimizer part itself. Keras has no public hook for "forward,
loss, loss tracker" alone, so this module repeats those lines of
`keras/src/backend/tensorflow/trainer.py` (`TensorFlowTrainer.train_step`,
Keras 3.15), touching three private members: `_call_has_training_arg`,
`_compute_loss` and `_loss_tracker`. `tests/_upstream/test_keras_train_step.py`
checks that one accumulation step with `accum_steps=1` matches Keras' own
train step (weights and logged loss), so a Keras change that breaks the copy
fails there first.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.losses.loss import unscale_loss_for_distribution

# pylint: disable=protected-access


def forward_and_loss(model: keras.Model, x, y, sample_weight):
    """Runs the model in training mode and computes its loss, as Keras does.

    Also updates the model's loss tracker with the unscaled loss, weighted by
    the number of examples, so the `loss` Keras logs is the example-weighted
    mean over everything seen in the epoch.

    Args:
        model: a compiled Keras model.
        x, y, sample_weight: one (micro-)batch.

    Returns:
        `(y_pred, loss)`: the predictions and the loss scaled for distribution
        (divided by the number of replicas in sync) and by the optimizer's
        loss scale, ready to differentiate.
    """
    if model._call_has_training_arg:
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    model._loss_tracker.update_state(
        unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0],
    )
    return y_pred, model.optimizer.scale_loss(loss)
