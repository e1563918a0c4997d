"""KV-cached generation matches transformers' greedy decoding and repeats under a seed."""

from __future__ import annotations

import pytest
import torch

from posttune_generate.kv_loop import filter_logits, generate
from posttune.testing.tiny import tiny_hf_model, tiny_llama_config, tiny_mistral_config

PROMPT = [5, 17, 300, 42, 7, 99]


@pytest.mark.parametrize("config", [
    tiny_llama_config(),
    tiny_llama_config(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    tiny_mistral_config(sliding_window=8),  # 6 + 20 tokens: decoding runs well past the window
], ids=["llama_gqa", "llama3_tied", "mistral_window"])
def test_greedy_matches_transformers_token_for_token(config, to_native):
    hf_model = tiny_hf_model(config)
    model = to_native(hf_model)
    expected = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=config.eos_token_id, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert generate(model, PROMPT, max_new_tokens=20, eos_token_ids=(config.eos_token_id,)) == expected


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_llama):
    runs = [generate(tiny_llama, PROMPT, max_new_tokens=12, temperature=1.0, seed=seed) for seed in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llama):
    greedy = generate(tiny_llama, PROMPT, max_new_tokens=8)
    assert generate(tiny_llama, PROMPT, max_new_tokens=8, temperature=1.0, top_k=1, seed=3) == greedy
    assert generate(tiny_llama, PROMPT, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_generation_stops_after_the_first_eos_token(tiny_llama):
    free = generate(tiny_llama, PROMPT, max_new_tokens=8)
    assert generate(tiny_llama, PROMPT, max_new_tokens=8, eos_token_ids=(free[2],)) == free[:3]


@pytest.mark.parametrize("top_k, top_p, min_p", [(None, 0.9, None), (None, 0.3, None), (10, None, None),
                                                  (None, None, 0.1), (20, 0.8, 0.05), (5, 0.5, None)])
def test_filters_keep_the_tokens_transformers_warpers_keep(top_k, top_p, min_p):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    expected = logits.clone()
    for value, warper in ((top_k, TopKLogitsWarper), (top_p, TopPLogitsWarper), (min_p, MinPLogitsWarper)):
        if value is not None:  # transformers' order: top-k, top-p, min-p
            expected = warper(value)(None, expected)
    got = filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    assert torch.equal(got.isfinite(), expected.isfinite())
    assert torch.equal(got[got.isfinite()], logits[got.isfinite()])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert filter_logits(logits, top_p=0.8).isfinite().tolist() == [[True, True, False, False]]


@pytest.mark.parametrize(("vocab", "top_p"), [(2, 0.5), (4, 0.5), (4, 0.75)])
def test_top_p_mass_that_reaches_p_exactly_is_enough(vocab, top_p):
    """Equally likely tokens, whose probabilities and their sums are exact in floating point: the nucleus ends at
    the token that brings its mass to exactly ``top_p`` (transformers' TopPLogitsWarper), so sampling never draws
    the next token beyond it."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.zeros(1, vocab)
    expected = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
    assert int(expected.sum()) == round(vocab * top_p)
    assert int(filter_logits(logits, top_p=top_p).isfinite().sum()) == int(expected.sum())
