"""The decoder options families switch on (soft-capping, post-norms, embedding scale, local RoPE),
specified one behaviour at a time against textbook formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttune.modules import (Attention, Decoder, DecoderLayer, GatedMLP, KVCache, RMSNorm, RotaryEmbedding,
                              attention_mask, default_positions, explicit_attention, soft_cap)

VOCAB = 64


def decoder(*, attn_cap: float | None = None, logit_cap: float | None = None, window: int | None = None,
            post_norms: bool = False, embed_scale: float | None = None, local_theta: float | None = None,
            seed: int = 0) -> Decoder:
    """Two layers (the first sliding-window when ``window``), hidden 32, 4 query heads over 2 kv heads."""
    torch.manual_seed(seed)
    layers = [DecoderLayer(Attention(32, 4, 2, 8, sliding_window=window if index == 0 else None, softcap=attn_cap),
                           GatedMLP(32, 64), RMSNorm(32), RMSNorm(32),
                           attn_post_norm=RMSNorm(32) if post_norms else None,
                           mlp_post_norm=RMSNorm(32) if post_norms else None) for index in range(2)]
    local = RotaryEmbedding(8, theta=local_theta) if local_theta is not None else None
    return Decoder(nn.Embedding(VOCAB, 32), layers, RMSNorm(32), RotaryEmbedding(8), embed_scale=embed_scale,
                   local_rope=local, logit_softcap=logit_cap).eval()


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_soft_cap_is_cap_times_tanh_and_none_is_identity():
    x = torch.linspace(-100, 100, 11)
    torch.testing.assert_close(soft_cap(x, 30.0), 30.0 * torch.tanh(x / 30.0))
    assert soft_cap(x, None) is x
    assert soft_cap(x, 30.0).abs().max() < 30.0


@pytest.mark.parametrize("q_len, kv_len, window, documents", [
    (6, 6, None, False), (6, 6, 3, False), (6, 6, None, True), (1, 9, None, False), (3, 9, 4, False)])
def test_explicit_attention_without_a_cap_equals_sdpa(q_len, kv_len, window, documents):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, q_len, 8), torch.randn(2, 2, kv_len, 8), torch.randn(2, 2, kv_len, 8)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]]) if documents else None
    mask = attention_mask(q_len, kv_len, document_ids=doc_ids, sliding_window=window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1,
                                              enable_gqa=True)
    torch.testing.assert_close(explicit_attention(q, k, v, mask), expected)


def test_soft_capped_attention_caps_scaled_scores_before_masking_and_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8) * 4, torch.randn(1, 1, 5, 8) * 4, torch.randn(1, 1, 5, 8)
    scale, cap = 0.2, 2.0
    scores = 2.0 * torch.tanh(q @ k.expand(1, 2, 5, 8).transpose(-2, -1) * scale / cap)
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    expected = scores.softmax(-1) @ v.expand(1, 2, 5, 8)
    torch.testing.assert_close(explicit_attention(q, k, v, None, scale=scale, softcap=cap), expected)


def test_soft_capped_attention_trains_on_cpu_with_packed_documents():
    model = decoder(attn_cap=1.0, logit_cap=5.0, window=3).train()
    ids, docs = tokens(2, 8), torch.tensor([[0] * 4 + [1] * 4, [0] * 8])
    model(ids, document_ids=docs).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_chunks_give_the_full_forward_logits_with_every_option_on(window):
    model = decoder(attn_cap=1.0, logit_cap=5.0, window=window, post_norms=True, embed_scale=32 ** 0.5,
                    local_theta=100.0)
    ids = tokens(1, 10)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(10)
        chunks = [model(ids[:, :4], kv_cache=cache)] + [model(ids[:, i:i + 1], kv_cache=cache) for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full)


def test_logit_softcap_applies_in_forward_and_logits_but_not_hidden_states():
    model = decoder(logit_cap=0.05)
    ids = tokens(1, 6)
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        torch.testing.assert_close(model(ids), 0.05 * torch.tanh(model.output(hidden) / 0.05))
        torch.testing.assert_close(model.logits(hidden), model(ids))


def test_post_norms_normalise_each_block_output_before_the_residual():
    model = decoder(post_norms=True)
    layer, x = model.layers[1], torch.randn(1, 5, 32)
    nn.init.normal_(layer.attn_post_norm.weight)
    cos, sin = model.rope(default_positions(1, 5))
    h = x + layer.attn_post_norm(layer.attn(layer.attn_norm(x), cos, sin, None))
    expected = h + layer.mlp_post_norm(layer.mlp(layer.mlp_norm(h)))
    torch.testing.assert_close(layer(x, cos, sin, None), expected)


def test_layers_without_post_norms_keep_the_plain_pre_norm_state_dict():
    names = set(decoder().state_dict())
    assert not any("post_norm" in name for name in names)
    with_post_norms = set(decoder(post_norms=True).state_dict())
    assert {"layers.0.attn_post_norm.weight", "layers.0.mlp_post_norm.weight"} <= with_post_norms


def test_embed_scale_is_rounded_to_the_embedding_dtype_first():
    model = decoder(embed_scale=3072 ** 0.5).to(torch.bfloat16)
    ids = tokens(1, 4)
    seen = {}
    model.layers[0].register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))
    with torch.no_grad():
        model(ids)
    assert torch.tensor(3072 ** 0.5).to(torch.bfloat16).item() == 55.5
    torch.testing.assert_close(seen["x"], model.embed(ids) * torch.tensor(55.5, dtype=torch.bfloat16), rtol=0, atol=0)


def test_local_rope_rotates_only_the_sliding_window_layers():
    same = decoder(window=3, local_theta=10000.0)
    plain = decoder(window=3)
    other = decoder(window=3, local_theta=10.0)
    ids = tokens(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(same(ids), plain(ids))  # same base: same model
        assert (other(ids) - plain(ids)).abs().max() > 1e-4
        for model in (plain, other):  # without a window layer, local_rope is never used
            model.layers[0].attn.sliding_window = None
        torch.testing.assert_close(other(ids), plain(ids))
