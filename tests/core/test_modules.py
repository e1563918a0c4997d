"""The shared building blocks (posttune.modules), specified one behaviour at a time."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from posttune.errors import PosttuneError
from posttune.modules import (Attention, Decoder, DecoderLayer, GatedMLP, KVCache, RMSNorm, RotaryEmbedding,
                              apply_rotary, attention_mask, default_positions, init_buffers, rope_frequencies)
from posttune.modules.mlp import get_activation

VOCAB = 64


def tiny_decoder(*, tie: bool = False, window: int | None = None, kv_heads: int = 2, seed: int = 0) -> Decoder:
    """Two layers, hidden 32, 4 query heads of 8 dims: the blocks composed with no model family."""
    torch.manual_seed(seed)
    layers = [DecoderLayer(Attention(32, 4, kv_heads, 8, sliding_window=window), GatedMLP(32, 64),
                           RMSNorm(32), RMSNorm(32)) for _ in range(2)]
    return Decoder(nn.Embedding(VOCAB, 32), layers, RMSNorm(32), RotaryEmbedding(8), tie_word_embeddings=tie).eval()


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# --- RMSNorm -------------------------------------------------------------------------------------

def test_rmsnorm_divides_by_root_mean_square_then_scales():
    norm = RMSNorm(8, eps=1e-6)
    nn.init.normal_(norm.weight)
    x = torch.randn(3, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_rmsnorm_offset_scales_by_one_plus_weight_and_starts_as_identity_scale():
    plain, offset = RMSNorm(8), RMSNorm(8, offset=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(offset(x), plain(x))  # zeros-initialised offset == ones-initialised weight
    nn.init.normal_(offset.weight)
    with torch.no_grad():
        plain.weight.copy_(1 + offset.weight)
    torch.testing.assert_close(offset(x), plain(x))


# --- RoPE ----------------------------------------------------------------------------------------

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16},
    # LongRoPE: 32 factors for a 64-dim head; seq_len 1000 > 64 takes the long ones
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + i / 16 for i in range(32)], "long_factor": [1.0 + i for i in range(32)]},
    # an explicit factor sets the attention scale instead of max_position_embeddings / original
    "longrope_factor": {"rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 32.0,
                        "short_factor": [1.0] * 32, "long_factor": [2.0] * 32},
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
@pytest.mark.parametrize("seq_len", [None, 1000])
def test_rope_frequencies_match_transformers(name, seq_len):
    scaling = ROPE_CASES[name]
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=256,
                                      rope_parameters={"rope_theta": 50000.0, **(scaling or {"rope_type": "default"})})
    if scaling is None:
        expected, expected_factor = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding \
            .compute_default_rope_parameters(config)
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)
    got, factor = rope_frequencies(64, 50000.0, scaling, max_position_embeddings=256, seq_len=seq_len)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_unknown_rope_type_is_a_one_line_error_listing_the_supported_ones():
    with pytest.raises(PosttuneError) as error:
        RotaryEmbedding(8, scaling={"type": "su"})
    assert str(error.value) == ("unknown RoPE scaling type 'su' "
                                "(supported: default, dynamic, linear, llama3, longrope, yarn)")


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, theta=100.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        cos, sin = rope(torch.tensor([[m, n]]))
        return (apply_rotary(q, cos[:, :1], sin[:, :1]) * apply_rotary(k, cos[:, 1:], sin[:, 1:])).sum()

    torch.testing.assert_close(score(7, 3), score(14, 10))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


def test_rope_angles_stay_fp32_after_the_model_is_cast_to_bf16():
    rope = RotaryEmbedding(16, theta=500000.0)
    positions = torch.tensor([[0, 4000, 8000]])
    expected = rope(positions)
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.bfloat16
    for got, want in zip(rope(positions), expected):
        torch.testing.assert_close(got, want)


# --- masks and positions -------------------------------------------------------------------------

def test_sliding_window_keeps_the_current_token_and_the_window_minus_one_before_it():
    mask = attention_mask(6, 6, sliding_window=3)[0, 0]
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]


def test_mask_with_a_cache_offset_places_queries_at_the_end():
    mask = attention_mask(2, 5)[0, 0]
    assert mask.tolist() == [[True, True, True, True, False], [True] * 5]
    assert attention_mask(1, 5) is None and attention_mask(4, 4) is None  # SDPA's fused paths


def test_positions_restart_at_each_document():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert default_positions(1, 9, document_ids=documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


@pytest.mark.parametrize("window", [None, 3])
def test_packed_documents_give_the_logits_of_each_document_alone(window):
    model = tiny_decoder(window=window)
    lengths = (5, 3, 7)
    docs = [tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), document_ids=document_ids)
        alone = torch.cat([model(doc) for doc in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_document_masked_attention_has_gradients_on_cpu():
    model = tiny_decoder().train()
    ids = tokens(2, 8)
    document_ids = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    model(ids, document_ids=document_ids).logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# --- attention, MLP ------------------------------------------------------------------------------

def test_grouped_query_attention_equals_multi_head_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa, mha = Attention(32, 4, 2, 8), Attention(32, 4, 4, 8)
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("k_proj", "v_proj"):  # head h of MHA reads kv head h // 2
            weight = getattr(gqa, name).weight.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
            getattr(mha, name).weight.copy_(weight)
    x = torch.randn(2, 6, 32)
    cos, sin = RotaryEmbedding(8)(default_positions(2, 6))
    torch.testing.assert_close(gqa(x, cos, sin, None), mha(x, cos, sin, None))


def test_gated_mlp_activations_and_unknown_one():
    x = torch.randn(4)
    torch.testing.assert_close(get_activation("gelu_tanh")(x), nn.functional.gelu(x, approximate="tanh"))
    with pytest.raises(PosttuneError, match="'relu'"):
        GatedMLP(8, 16, activation="relu")


# --- decoder, KV cache, meta-device build --------------------------------------------------------

@pytest.mark.parametrize("window", [None, 4])
def test_kv_cache_chunks_give_the_full_forward_logits(window):
    model = tiny_decoder(window=window)
    ids = tokens(2, 12)
    cache = KVCache(max_len=12)
    with torch.no_grad():
        full = model(ids)
        chunks = [model(ids[:, a:b], kv_cache=cache) for a, b in ((0, 5), (5, 8), (8, 9), (9, 10), (10, 12))]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


def test_kv_cache_keeps_the_model_s_dtype():
    """A bfloat16 model's cache is bfloat16 (half the memory of float32, and attention needs the queries' dtype):
    chunked through it, the logits are the full bfloat16 forward's."""
    model = tiny_decoder().to(torch.bfloat16)
    ids = tokens(2, 8)
    cache = KVCache(max_len=8)
    with torch.no_grad():
        full = model(ids)
        chunks = [model(ids[:, a:b], kv_cache=cache) for a, b in ((0, 5), (5, 6), (6, 8))]
    assert {t.dtype for t in (*cache.keys.values(), *cache.values.values())} == {torch.bfloat16}
    torch.testing.assert_close(torch.cat(chunks, dim=1).float(), full.float(), rtol=0, atol=0.05)


def test_kv_cache_refuses_to_overflow():
    model = tiny_decoder()
    with pytest.raises(ValueError, match="KV cache is full"), torch.no_grad():
        model(tokens(1, 5), kv_cache=KVCache(max_len=4))


def test_kv_cache_buffers_are_freed_without_the_cyclic_collector(monkeypatch):
    """A cache in a reference cycle lives until Python's rare full collection: GRPO's rollouts left one
    generation batch's buffers behind per step that way and fragmented the heap to twice its live size."""
    import gc
    import weakref

    import posttune_generate.kv_loop as generation

    made: list[weakref.ref] = []

    class RecordedCache(KVCache):
        def __init__(self, max_len: int):
            super().__init__(max_len)
            made.append(weakref.ref(self))

    monkeypatch.setattr(generation, "KVCache", RecordedCache)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            generation.generate_batch(tiny_decoder(), [[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0,
                                      seed=0)
        alive = [cache for cache in made if cache() is not None]
    finally:
        if enabled:
            gc.enable()
    assert len(made) == 1 and not alive


def test_tied_output_head_is_the_embedding_and_hidden_states_feed_it():
    model = tiny_decoder(tie=True)
    assert model.output.weight is model.embed.weight
    ids = tokens(1, 5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model.hidden_states(ids) @ model.embed.weight.T)


def test_meta_device_build_materialises_with_init_buffers():
    reference = tiny_decoder(tie=True)
    with torch.device("meta"):
        model = Decoder(nn.Embedding(VOCAB, 32), [DecoderLayer(Attention(32, 4, 2, 8), GatedMLP(32, 64),
                        RMSNorm(32), RMSNorm(32)) for _ in range(2)], RMSNorm(32), RotaryEmbedding(8),
                        tie_word_embeddings=True)
    assert model.rope.inv_freq.is_meta
    model.to_empty(device="cpu")
    init_buffers(model)
    model.load_state_dict(reference.state_dict())
    assert model.output.weight is model.embed.weight
    torch.testing.assert_close(model.rope.inv_freq, reference.rope.inv_freq)
    ids = tokens(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids))
    assert "rope.inv_freq" not in model.state_dict()  # checkpoints never carry it
