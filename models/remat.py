"""Activation recomputation ("remat", gradient checkpointing) per model block.

This module owns `rematerialize_blocks`, which turns a functional Keras model
into one whose chosen blocks (a transformer encoder block, a ResNet residual
block) keep only their input for the backward pass and recompute everything
inside in it, and `Rematerialized`, the layer that does it for one block. The
builders (`tfdp.models.transformer`, `resnet_cifar`, `resnet50`) call it when
built with `remat=True`; it is the recipe for your own functional models too.

Why not `keras.RematScope`: it rematerialises layer by layer (each layer's
`call` in its own `keras.remat`), so every layer's input and output stay
alive and only the few temporaries inside one layer are recomputed; on the
TensorFlow backend `keras.remat` is `tf.recompute_grad`. A whole block under
one `tf.recompute_grad` keeps one tensor per block instead of ~10.

What `tf.recompute_grad` alone gets wrong, and this module fixes: the
recomputation in the backward pass runs the block's stateful ops a second
time. BatchNormalization would update its moving mean and variance twice per
step, and Dropout would draw a new mask (its seed generator advanced), so
the gradient would belong to another mask than the forward pass. Before the
recomputation the block's non-trainable state (moving statistics, seed
generator states) is set back to what the forward pass saw, and restored
afterwards: the gradients equal those without remat (tests/models/
test_remat.py) and the state moves once per step.

It does not own the architectures (the family modules do), nor memory
measurement (the README's numbers come from `bench`).
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdp.models")
class Rematerialized(keras.layers.Layer):
    """Runs a block (a layer or functional model) and recomputes it in the backward pass.

    In training, under a `tf.GradientTape` (Keras `fit`, `tfdp.Trainer`), the
    block's internal activations are not kept for the backward pass: only the
    block's inputs are, and the block runs again when its gradient is needed
    (about one more forward pass of the block per step). The block's
    non-trainable state (BatchNormalization moving statistics, Dropout seed
    generators) is updated once per step, as without remat, and the recomputed
    forward pass draws the same dropout masks. At inference it just calls the
    block.

    Args:
        block: the layer or model to recompute; its weights stay its own (the
            wrapper adds none).
        **kwargs: `keras.layers.Layer` arguments (`name`, ...).

    Call args:
        inputs: the block's inputs.
        training: passed to the block.
        mask: passed to the block (e.g. the transformer's padding mask).
    """

    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block
        self.supports_masking = True
        # The wrapper hands the block its input's mask and puts it on the
        # output (`compute_mask`); this keeps Keras from warning it is lost.
        block.supports_masking = True

    def build(self, input_shape):
        if not self.block.built:
            self.block.build(input_shape)
        self.built = True

    def call(self, inputs, training=None, mask=None):
        def forward(x):
            return self.block(x, training=training, mask=mask)

        if not training:
            return forward(inputs)
        return recompute(forward, self.block.non_trainable_variables)(inputs)

    def compute_mask(self, inputs, mask=None):
        return mask  # A block keeps its input's positions (a sequence's padding).

    def compute_output_shape(self, input_shape):
        return self.block.compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "block": keras.saving.serialize_keras_object(self.block)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["block"] = keras.saving.deserialize_keras_object(config["block"])
        return cls(**config)


def recompute(fn, state: Sequence = ()):
    """`keras.remat(fn)` whose recomputation leaves `state` as the forward pass left it.

    Args:
        fn: a function of one tensor (the block's input) to its output.
        state: the Keras variables `fn` assigns to (moving statistics, seed
            generator states): set back to their values before the forward
            pass while `fn` is recomputed, and to their values after it
            once the recomputation is done.

    Returns:
        A function of one tensor with `fn`'s value and gradient.
    """
    state = list(state)
    before = [tf.identity(v.value) for v in state]
    calls = []

    def run(x):
        if not calls:  # The forward pass (traced first).
            calls.append(True)
            return fn(x)
        # The recomputation in the backward pass: replay from the forward
        # pass's starting state, then put back the state the step has now.
        now = [tf.identity(v.value) for v in state]
        for variable, value in zip(state, before):
            variable.assign(value)
        with tf.control_dependencies([v.value for v in state]):
            outputs = fn(tf.identity(x))
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            for variable, value in zip(state, now):
                variable.assign(value)
        with tf.control_dependencies([v.value for v in state]):
            return tf.nest.map_structure(tf.identity, outputs)

    return keras.remat(run)


def remat_block(build, x, *, name: str):
    """Builds one block of a functional model as a `Rematerialized` sub-model.

    For use while building a functional model: instead of `x = build(x)`,
    `x = remat_block(build, x, name=...)`. The layers `build` creates are the
    same, created in the same order (so the same seed gives the same
    initial weights), but inside a sub-model on a fresh input. A mask on `x`
    (an `Embedding(mask_zero=True)` padding mask) reaches the block's layers
    at run time, and the block's output carries it on.

    Args:
        build: a function from a symbolic tensor to the block's output, which
            creates and calls the block's layers.
        x: the block's input (a symbolic tensor).
        name: the sub-model's name; the wrapper is `f"{name}_remat"`.

    Returns:
        The block's output, a symbolic tensor.
    """
    block_input = keras.Input(batch_shape=x.shape, dtype=x.dtype, name=f"{name}_input")
    block = keras.Model(block_input, build(block_input), name=name)
    return Rematerialized(block, name=f"{name}_remat")(x)


def rematerialize_blocks(
    model: keras.Model, *, start: str, ends: Sequence[str], name: str | None = None
) -> keras.Model:
    """Returns `model` with each block recomputed in the backward pass.

    The new model shares `model`'s layers and weights (they are the same
    variables) and computes the same outputs; each block becomes one
    `Rematerialized` layer over a functional sub-model of the original layers.
    Its checkpoint layout differs from `model`'s (the layers sit inside the
    blocks): resume a run with the `remat` setting it was saved with.

    The model must not carry masks (the original graph passes them to each
    layer from the model's input, so a block cut out of it would not be
    connected); build such models with `remat_block` instead.

    Args:
        model: a functional Keras model without masks.
        start: the layer whose output is the first block's input.
        ends: the last layer of each block, in order: block `i` runs from the
            output of `ends[i - 1]` (or of `start`) to the output of
            `ends[i]`, and must depend on the rest of the model only through
            that input (a residual block, an encoder block).

    Returns:
        A functional `keras.Model` with `model`'s inputs and outputs.

    Raises:
        ValueError: `ends` is empty, or a name is not a layer of `model`.

    Example (your own functional model, blocks ending at "block_1_out", ...):

    ```python
    model = rematerialize_blocks(model, start="stem_relu",
                                 ends=[f"block_{i}_out" for i in range(1, 9)])
    ```
    """
    ends = list(ends)
    if not ends:
        raise ValueError("`ends` must name the last layer of at least one block to "
                         f"recompute. Received: ends={ends!r}")
    known = {layer.name for layer in model.layers}
    unknown = [n for n in [start, *ends] if n not in known]
    if unknown:
        raise ValueError(f"Model {model.name!r} has no layer(s) {', '.join(unknown)}. "
                         f"Received: start={start!r}, ends={ends!r}")
    outputs = [_single(model.get_layer(n).output, n) for n in [start, *ends]]
    def single(tensors):  # A one-input model takes a tensor, not a list of one.
        return tensors[0] if len(tensors) == 1 else tensors

    stem = keras.Model(single(model.inputs), outputs[0], name=f"{model.name}_stem")
    head = keras.Model(outputs[-1], single(model.outputs), name=f"{model.name}_head")
    inputs = single([keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name)
                     for t in model.inputs])
    x = stem(inputs)
    for end, block_in, block_out in zip(ends, outputs, outputs[1:]):
        block = keras.Model(block_in, block_out, name=f"{end}_block")
        x = Rematerialized(block, name=f"{end}_remat")(x)
    return keras.Model(inputs, head(x), name=name or model.name)


def _single(tensor, layer_name):
    if isinstance(tensor, (list, tuple)):
        if len(tensor) != 1:
            raise ValueError(f"A block boundary must be a layer with one output; "
                             f"{layer_name!r} has {len(tensor)}.")
        tensor = tensor[0]
    return tensor
