"""Batched generation: left-padded rows generate what they would alone, greedy equals transformers,
sampling depends only on each row's seed, and every rank runs the same number of forwards."""

from __future__ import annotations

import json
import os

import pytest
import torch
from rank_support import run_ranks
from torch import nn

from posttune.generation import _mix, _mix_int, derive_seed, uniform_noise
from posttune_generate.kv_loop import filter_logits, generate_batch
from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, KVCache, RMSNorm, RotaryEmbedding
from posttune.testing.tiny import tiny_hf_model, tiny_llama_config, tiny_mistral_config

LENGTHS = [3, 9, 1, 12, 6, 7, 2, 10]
PROMPTS = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(i)).tolist()
           for i, n in enumerate(LENGTHS)]
EOS = 2


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) as transformers takes a left-padded batch."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


# ---- greedy: exact ----------------------------------------------------------------------------

@pytest.mark.parametrize("config", [tiny_llama_config(), tiny_mistral_config(sliding_window=6)],
                         ids=["llama", "mistral_window"])  # 12 + 20 tokens run well past a 6-token window
def test_greedy_batch_matches_transformers_and_each_prompt_alone(config, to_native):
    hf_model = tiny_hf_model(config)
    model = to_native(hf_model)
    ids, mask = left_padded(PROMPTS)
    expected = hf_model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=0)[:, ids.shape[1]:]
    out = generate_batch(model, PROMPTS, max_new_tokens=20, stop_token_ids=(EOS,))
    assert out.tokens.tolist() == expected.tolist()
    alone = [generate_batch(model, [p], max_new_tokens=20, stop_token_ids=(EOS,)).token_lists()[0] for p in PROMPTS]
    assert out.token_lists() == alone


def test_a_row_stops_at_its_stop_token_and_is_padded_after_it(tiny_llama):
    free = generate_batch(tiny_llama, PROMPTS, max_new_tokens=12).token_lists()
    stop = free[0][2]
    cut = [row.index(stop) + 1 if stop in row else len(row) for row in free]
    out = generate_batch(tiny_llama, PROMPTS, max_new_tokens=12, stop_token_ids=(stop,), pad_id=7)
    width = max(cut)
    assert out.tokens.shape == out.mask.shape == out.logprobs.shape == (len(PROMPTS), width)
    assert out.tokens.tolist() == [row[:n] + [7] * (width - n) for row, n in zip(free, cut, strict=True)]
    assert out.mask.tolist() == [[True] * n + [False] * (width - n) for n in cut]
    assert (out.logprobs[~out.mask] == 0).all() and (out.logprobs[out.mask] < 0).all()
    assert out.token_lists()[0][-1] == stop


# ---- sampling: seeded per row -----------------------------------------------------------------

def test_sampling_repeats_under_a_seed_and_changes_with_it(tiny_llama):
    runs = [generate_batch(tiny_llama, PROMPTS, max_new_tokens=10, temperature=1.0, seed=s).tokens for s in (0, 0, 1)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_a_rows_sample_does_not_depend_on_the_rest_of_the_batch(tiny_llama):
    seeds = [derive_seed(5, i) for i in range(len(PROMPTS))]
    kwargs = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.95}
    full = generate_batch(tiny_llama, PROMPTS, seeds=seeds, **kwargs).token_lists()
    alone = [generate_batch(tiny_llama, [p], seeds=[s], **kwargs).token_lists()[0]
             for p, s in zip(PROMPTS, seeds, strict=True)]
    part = generate_batch(tiny_llama, PROMPTS[3:6], seeds=seeds[3:6], **kwargs).token_lists()
    assert full == alone
    assert part == full[3:6]
    assert generate_batch(tiny_llama, PROMPTS, seed=5, **kwargs).token_lists() == full  # seed: row i's is derived


def test_top_k_one_tiny_top_p_and_min_p_one_are_greedy(tiny_llama):
    greedy = generate_batch(tiny_llama, PROMPTS, max_new_tokens=8).tokens
    for option in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        sampled = generate_batch(tiny_llama, PROMPTS, max_new_tokens=8, temperature=1.0, seed=3, **option).tokens
        assert torch.equal(sampled, greedy), option


class FixedLogits(nn.Module):
    """A 'model' whose next-token logits are always ``logits``, whatever the input."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits, requires_grad=False)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.logits.expand(*input_ids.shape, -1)


def test_gumbel_max_samples_the_filtered_renormalised_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    model = FixedLogits(probs.log())
    rows = [[1]] * 4000
    plain = generate_batch(model, rows, max_new_tokens=1, temperature=1.0, seed=0).tokens[:, 0]
    torch.testing.assert_close(torch.bincount(plain, minlength=4) / 4000.0, probs, atol=0.025, rtol=0)
    nucleus = generate_batch(model, rows, max_new_tokens=1, temperature=1.0, top_p=0.7, seed=0).tokens[:, 0]
    torch.testing.assert_close(torch.bincount(nucleus, minlength=4) / 4000.0,
                               torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.025, rtol=0)


def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.1, 0.7, 0.1]]))
    kept = filter_logits(logits, min_p=0.25).isfinite()  # keep p >= 0.125, then p >= 0.175
    assert kept.tolist() == [[True, True, True, False], [False, False, True, False]]
    assert filter_logits(logits, min_p=0.0).isfinite().all()


# ---- log-probabilities ------------------------------------------------------------------------

def test_a_repeated_prompt_is_prefilled_once_and_each_copy_samples_what_it_would_alone(tiny_llama):
    """GRPO's groups: each prompt G times. The prefill runs over the distinct prompts only (their KV
    cache rows copied to the group), and every row's completion and log-probs are those of the row
    generated alone."""
    groups = [PROMPTS[i] for i in (0, 3, 3, 0, 5, 3, 1, 5)]  # 4 distinct prompts, interleaved copies
    seeds = [derive_seed(9, i) for i in range(len(groups))]
    kwargs = {"max_new_tokens": 8, "temperature": 0.9, "top_k": 50}
    batches = []
    handle = tiny_llama.register_forward_pre_hook(lambda _m, args: batches.append(tuple(args[0].shape)))
    try:
        out = generate_batch(tiny_llama, groups, seeds=seeds, **kwargs)
    finally:
        handle.remove()
    assert batches[0] == (4, max(map(len, groups)))  # the prefill: one row per distinct prompt
    assert {shape[0] for shape in batches[1:]} == {len(groups)}  # then every row decodes
    for row, (prompt, seed) in enumerate(zip(groups, seeds, strict=True)):
        alone = generate_batch(tiny_llama, [prompt], seeds=[seed], **kwargs)
        assert out.token_lists()[row] == alone.token_lists()[0]
        size = len(alone.token_lists()[0])
        torch.testing.assert_close(out.logprobs[row][:size], alone.logprobs[0][:size], atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_a_fresh_forward_over_prompt_and_completion(tiny_llama, temperature):
    out = generate_batch(tiny_llama, PROMPTS, max_new_tokens=10, temperature=temperature, top_k=20, seed=4)
    for prompt, completion, logprobs in zip(PROMPTS, out.token_lists(), out.logprobs, strict=True):
        with torch.no_grad():
            logits = tiny_llama(torch.tensor([prompt + completion]))[0, len(prompt) - 1:-1]
        expected = (logits / (temperature or 1.0)).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])
        torch.testing.assert_close(logprobs[:len(completion)], expected[:, 0], atol=1e-5, rtol=0)


# ---- the noise --------------------------------------------------------------------------------

def test_counter_noise_is_uniform_in_the_open_interval_and_never_repeats_within_a_row():
    seeds = torch.tensor([0, 1, -5, 2**62, derive_seed(7, 3)])
    noise = torch.stack([uniform_noise(seeds, step, 4096) for step in range(3)], dim=1)  # [rows, steps, vocab]
    assert noise.dtype == torch.float64 and ((noise > 0) & (noise < 1)).all()
    assert abs(noise.mean().item() - 0.5) < 0.01
    histogram = torch.histc(noise.float(), bins=10, min=0, max=1) / noise.numel()
    assert (histogram - 0.1).abs().max() < 0.01
    assert all(row.unique().numel() == row.numel() for row in noise)
    assert torch.equal(noise[:, 0], uniform_noise(seeds, 0, 4096))  # a pure function of (seed, step, token)
    assert torch.equal(uniform_noise(seeds[2:3], 1, 4096), noise[2:3, 1])  # and not of the other rows


def test_the_int64_hash_equals_64_bit_unsigned_arithmetic():
    values = [0, 1, -1, 2**63 - 1, -2**63, 12345678901234567, -987654321987654321]
    mixed = _mix(torch.tensor(values))
    assert [v % 2**64 for v in mixed.tolist()] == [_mix_int(v % 2**64) for v in values]


def test_derived_seeds_are_deterministic_and_distinct():
    seeds = [derive_seed(0, i, j) for i in range(20) for j in range(20)]
    assert len(set(seeds)) == len(seeds)
    assert derive_seed(0, 3, 4) == seeds[3 * 20 + 4] and derive_seed(0) != derive_seed(1)
    assert all(-2**63 <= s < 2**63 for s in seeds)


def test_conflicting_seed_arguments_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="not both"):
        generate_batch(tiny_llama, PROMPTS[:2], max_new_tokens=2, temperature=1.0, seed=1, seeds=[1, 2])
    with pytest.raises(ValueError, match="2 prompts"):
        generate_batch(tiny_llama, PROMPTS[:2], max_new_tokens=2, temperature=1.0, seeds=[1])


# ---- the decoder's padding mask ---------------------------------------------------------------

def decoder(window: int | None, cap: float | None) -> Decoder:
    """Two layers, the first with a sliding window when ``window``; ``cap`` soft-caps scores (explicit path)."""
    torch.manual_seed(0)
    layers = [DecoderLayer(Attention(32, 4, 2, 8, sliding_window=window if index == 0 else None, softcap=cap),
                           GatedMLP(32, 64), RMSNorm(32), RMSNorm(32)) for index in range(2)]
    return Decoder(nn.Embedding(64, 32), layers, RMSNorm(32), RotaryEmbedding(8)).eval()


@pytest.mark.parametrize(("window", "cap"), [(None, None), (3, None), (3, 20.0)], ids=["full", "window", "softcap"])
def test_a_left_padded_row_has_the_logits_of_the_row_alone(window, cap):
    model = decoder(window, cap)
    short, full = torch.randint(1, 64, (1, 5)), torch.randint(1, 64, (1, 8))
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), full])
    padding = torch.tensor([[False] * 3 + [True] * 5, [True] * 8])
    with torch.no_grad():
        cache = KVCache(9)
        padded = model(ids, padding_mask=padding, kv_cache=cache)
        step = model(torch.tensor([[9], [9]]), kv_cache=cache,
                     padding_mask=torch.cat([padding, torch.ones(2, 1, dtype=torch.bool)], dim=1))
        alone = model(torch.cat([short, torch.tensor([[9]])], dim=1))
        reference = model(torch.cat([full, torch.tensor([[9]])], dim=1))
    assert padded.isfinite().all()  # padding queries attend to themselves: no NaN reaches any row
    torch.testing.assert_close(padded[0, 3:], alone[0, :5], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[0, 0], alone[0, 5], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1], reference[0, :8], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[1, 0], reference[0, 8], atol=1e-5, rtol=0)


# ---- distributed: the same forward count on every rank ----------------------------------------

RANK_PROGRAM = r"""
import json, sys
import torch, torch.distributed as dist
import posttune_llama
from posttune_generate import generate_batch
from posttune.training import distributed
from posttune.testing.tiny import native_from_hf, tiny_hf_model, tiny_llama_config
torch.set_num_threads(1)
dist.init_process_group("gloo")
converter = {c.family: c for c in posttune_llama.CONVERTERS}["llama"]
model = native_from_hf(tiny_hf_model(tiny_llama_config()), posttune_llama.LLAMA, converter)
forwards = []
model.register_forward_hook(lambda *_: forwards.append(1))
job = json.loads(sys.argv[1])[dist.get_rank()]
out = generate_batch(model, job["prompts"], max_new_tokens=8, temperature=1.0, seeds=job["seeds"],
                     stop_token_ids=job["stop"])
print(json.dumps({"forwards": len(forwards), "tokens": out.token_lists()}))
distributed.shutdown()  # barrier, then destroy: a rank leaving a live gloo group can abort at exit
"""


@pytest.mark.slow
def test_every_rank_runs_the_same_forwards_and_samples_what_one_process_would(tiny_llama):
    jobs = [{"prompts": PROMPTS[:3], "seeds": [1, 2, 3], "stop": list(range(512))},  # done after one token
            {"prompts": PROMPTS[3:], "seeds": [4, 5, 6, 7, 8], "stop": []}]  # runs all 8 steps
    results = run_ranks(RANK_PROGRAM, json.dumps(jobs), env=dict(os.environ))
    assert [r["forwards"] for r in results] == [8, 8]
    for job, result in zip(jobs, results, strict=True):
        alone = generate_batch(tiny_llama, job["prompts"], max_new_tokens=8, temperature=1.0, seeds=job["seeds"],
                               stop_token_ids=job["stop"])
        assert result["tokens"] == alone.token_lists()
    assert all(len(row) == 1 for row in results[0]["tokens"])
