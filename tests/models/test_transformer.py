"""The transformer classifier: padding is masked, both layer-norm placements build."""

import numpy as np
import pytest

from tfdp import models

SMALL = dict(vocab_size=20, num_layers=1, num_heads=2, hidden=8, num_classes=3)
TOKENS = np.array([[5, 6, 7, 0, 0, 0], [3, 0, 0, 0, 0, 0]], "int32")


@pytest.mark.slow
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("remat", [False, True])
def test_padding_tokens_do_not_change_the_logits(norm_first, num_layers, remat):
    """In every block, not only the first (Keras' MultiHeadAttention drops its input's mask)."""
    model = models.get("transformer", input_shape=(6,), norm_first=norm_first,
                       **{**SMALL, "num_layers": num_layers, "remat": remat})
    before = np.asarray(model(TOKENS, training=False))
    embedding = model.get_layer("token_embedding").embeddings
    table = embedding.numpy()
    rng = np.random.default_rng(0)
    table[0] = rng.normal(size=table.shape[1]) * 5  # Padding's vector.
    embedding.assign(table)
    np.testing.assert_allclose(model(TOKENS, training=False), before, atol=1e-5)
    table[5] = rng.normal(size=table.shape[1])  # A real token's vector does matter.
    embedding.assign(table)
    assert not np.allclose(model(TOKENS, training=False), before, atol=1e-5)


def test_post_layer_norm_variant_has_no_final_norm():
    pre = models.get("transformer", input_shape=(6,), **SMALL)
    post = models.get("transformer", input_shape=(6,), norm_first=False, **SMALL)
    assert "final_norm" in [l.name for l in pre.layers]
    assert "final_norm" not in [l.name for l in post.layers]
    assert "embedding_norm" in [l.name for l in post.layers]


def test_intermediate_defaults_to_four_times_hidden():
    model = models.get("transformer", input_shape=(6,), **SMALL)
    assert model.get_layer("encoder_0_ffn_1").units == 4 * SMALL["hidden"]
