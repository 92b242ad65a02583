"""`transformer`: a small Transformer encoder classifier over token ids.

This module owns the BERT-style text classifier (the model LAMB was made
for): token embedding plus learned position embedding, `num_layers` encoder
blocks (multi-head self-attention and a GELU feed-forward network, each in a
residual branch with layer normalisation before it (pre-LN, default) or
after the residual sum (post-LN, as in the original Transformer and BERT)),
mean pooling over the non-padding tokens, and the float32 logits head.

Token id 0 is padding (what `pipelines.pad_tokens` appends): the embedding's
mask keeps padding out of the attention keys and the mean.
"""

from __future__ import annotations

import functools
from typing import Sequence

import keras

from tfdp.models import common
from tfdp.models import registry
from tfdp.models import requirements
from tfdp.models import remat as remat_lib

NAME = "transformer"


@keras.saving.register_keras_serializable(package="tfdp.models")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a sequence of embeddings.

    Args:
        sequence_length: the (fixed) number of positions.
        initializer: initialiser of the `(sequence_length, features)` table
            (anything `keras.initializers.get` takes). Defaults to
            `TruncatedNormal(stddev=0.02)`, as in BERT.
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call args:
        inputs: embeddings of shape `(batch, sequence_length, features)`.

    Returns:
        `inputs` plus the position table, same shape; the input mask passes
        through.
    """

    def __init__(self, *, sequence_length: int, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length
        self.initializer = keras.initializers.get(
            initializer or keras.initializers.TruncatedNormal(stddev=0.02)
        )
        self.supports_masking = True

    def build(self, input_shape):
        if input_shape[-2] is not None and input_shape[-2] != self.sequence_length:
            raise ValueError(
                f"PositionEmbedding expects sequences of exactly {self.sequence_length} "
                f"positions (its `sequence_length`). Received: input_shape="
                f"{tuple(input_shape)}. Pad or truncate the sequences to "
                f"{self.sequence_length} tokens (pipelines.pad_tokens)."
            )
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.sequence_length, input_shape[-1]),
            initializer=self.initializer,
        )

    def call(self, inputs):
        return inputs + keras.ops.cast(self.embeddings, inputs.dtype)

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length,
                "initializer": keras.initializers.serialize(self.initializer)}


def _encoder_block(x, key_mask=None, *, num_heads: int, hidden: int, intermediate: int,
                   dropout: float, norm_first: bool, name: str):
    def norm(suffix):
        return keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_{suffix}")

    # Self-attention branch. MultiHeadAttention removes the padding mask from
    # the tensors it is called on (keras/src/layers/attention/
    # multi_head_attention.py, `call`): post-LN calls it on the residual
    # stream itself, whose mask is then gone for every later block. So the
    # keys' padding is also given explicitly, when known: `key_mask`,
    # `(batch, 1, sequence_length)`, True for real tokens.
    y = norm("attention_norm")(x) if norm_first else x
    y = keras.layers.MultiHeadAttention(
        num_heads, hidden // num_heads, dropout=dropout, name=f"{name}_attention"
    )(y, y, attention_mask=key_mask)
    if dropout:
        y = keras.layers.Dropout(dropout, name=f"{name}_attention_dropout")(y)
    x = keras.layers.Add(name=f"{name}_attention_add")([x, y])
    if not norm_first:
        x = norm("attention_norm")(x)
    # Feed-forward branch.
    y = norm("ffn_norm")(x) if norm_first else x
    y = keras.layers.Dense(intermediate, activation="gelu", name=f"{name}_ffn_1")(y)
    y = keras.layers.Dense(hidden, name=f"{name}_ffn_2")(y)
    if dropout:
        y = keras.layers.Dropout(dropout, name=f"{name}_ffn_dropout")(y)
    x = keras.layers.Add(name=f"{name}_ffn_add")([x, y])
    if not norm_first:
        x = norm("ffn_norm")(x)
    return x


@registry.register(NAME, inputs=requirements.TOKENS)
def transformer(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    vocab_size: int = 1000,
    num_layers: int = 2,
    num_heads: int = 4,
    hidden: int = 128,
    intermediate: int | None = None,
    dropout: float = 0.1,
    norm_first: bool = True,
    remat: bool = False,
) -> keras.Model:
    """Builds the Transformer encoder classifier.

    Args:
        input_shape: `(sequence_length,)`: token ids per example, padded or
            truncated to a fixed length (`pipelines.pad_tokens(length=...)`).
        num_classes: logit width (>= 2).
        vocab_size: token ids are in `[0, vocab_size)`; 0 is padding.
            Defaults to 1000 (the `synthetic_tokens` default).
        num_layers: encoder blocks. Defaults to 2.
        num_heads: attention heads per block; must divide `hidden`.
            Defaults to 4.
        hidden: model width (embedding and residual stream). Defaults to 128.
        intermediate: feed-forward width. Defaults to `4 * hidden`.
        dropout: dropout rate on embeddings, attention weights and each
            residual branch, in [0, 1). Defaults to 0.1.
        norm_first: layer normalisation before each branch (pre-LN, stable
            without warmup) or after each residual sum (post-LN, BERT).
            Defaults to True.
        remat: recompute each encoder block's activations in the backward
            pass instead of keeping them (`tfdp.models.remat`): less memory
            for about one more forward pass per step; same gradients.
            Defaults to False.

    Returns:
        A `keras.Model` from int32 token ids `(batch, sequence_length)` to
        float32 logits `(batch, num_classes)`.

    Raises:
        ValueError: `input_shape` is not `(sequence_length,)`, `num_heads`
            does not divide `hidden`, or another argument is invalid.
    """
    (sequence_length,) = common.check_input_shape(
        NAME, input_shape, rank=1, expected="(sequence_length,)",
        hint="The transformer reads token ids; for images use 'cnn' or 'resnet20'.",
    )
    num_classes = common.check_num_classes(NAME, num_classes)
    vocab_size = common.check_positive_int(NAME, "vocab_size", vocab_size)
    num_layers = common.check_positive_int(NAME, "num_layers", num_layers)
    num_heads = common.check_positive_int(NAME, "num_heads", num_heads)
    hidden = common.check_positive_int(NAME, "hidden", hidden)
    intermediate = common.check_positive_int(
        NAME, "intermediate", 4 * hidden if intermediate is None else intermediate
    )
    dropout = common.check_rate(NAME, "dropout", dropout)
    if not isinstance(norm_first, bool):
        raise ValueError(f"`norm_first` of model {NAME!r} must be True (pre-LN) or False "
                         f"(post-LN). Received: norm_first={norm_first!r}")
    common.check_bool(NAME, "remat", remat)
    if hidden % num_heads:
        raise ValueError(
            f"`num_heads` of model {NAME!r} must divide `hidden` (each head has "
            f"hidden / num_heads dimensions). Received: num_heads={num_heads}, "
            f"hidden={hidden}. Choose e.g. num_heads in "
            f"{[h for h in (1, 2, 4, 8, 16) if hidden % h == 0]}."
        )

    inputs = keras.Input((sequence_length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(
        vocab_size, hidden, mask_zero=True,
        embeddings_initializer=keras.initializers.TruncatedNormal(stddev=0.02),
        name="token_embedding",
    )(inputs)
    x = PositionEmbedding(sequence_length=sequence_length, name="position_embedding")(x)
    if not norm_first:
        x = keras.layers.LayerNormalization(epsilon=1e-6, name="embedding_norm")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
    real_tokens = keras.ops.not_equal(inputs, 0)  # (batch, sequence_length)
    key_mask = keras.ops.expand_dims(real_tokens, 1)
    for i in range(num_layers):
        block = functools.partial(
            _encoder_block, num_heads=num_heads, hidden=hidden, intermediate=intermediate,
            dropout=dropout, norm_first=norm_first, name=f"encoder_{i}")
        # A rematerialised block is a sub-model of one input: the mask reaches
        # its layers with that input (`remat_block`).
        x = (remat_lib.remat_block(block, x, name=f"encoder_{i}") if remat
             else block(x, key_mask))
    if norm_first:
        x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x, mask=real_tokens)
    return keras.Model(inputs, common.logits(x, num_classes), name=NAME)
