"""The core's generation engine, ``builtin``, through the engine protocol: on the live policy it is
``generate_batch`` on that very model; started without one (as in a Ray actor) it builds the
architecture, has no weights (version -1) until ``update_weights`` gives them, then generates what
the model it was given the weights of does; a state dict that does not fit is one line; and the
sampling settings are checked when they are made."""

from __future__ import annotations

import posttune_llama
import posttune_generate
import posttune_lora
import pytest
import torch
from posttune.generation import Sampling, SamplingError
from posttune_generate import generate_batch
from posttune.plugin import EnginePolicy, PosttuneError, build_model, start_engine

PROMPTS = [[5, 17, 300, 42], [9, 4], [7, 7, 7]]
SAMPLING = Sampling(6, temperature=1.0, top_k=50, stop_token_ids=(2,), pad_id=0)
SEEDS = [11, 12, 13]


@pytest.fixture
def policy(register_plugin) -> torch.nn.Module:
    """A tiny Llama with seeded random weights, as `posttune train` builds the policy (with its origin)."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    model = build_model("llama", "tiny", vocab_size=384)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return model.eval()


def expected(model: torch.nn.Module) -> list[list[int]]:
    return generate_batch(model, PROMPTS, max_new_tokens=6, temperature=1.0, top_k=50, seeds=SEEDS,
                          stop_token_ids=(2,), pad_id=0).token_lists()


def test_on_the_live_policy_it_is_generate_batch_on_that_model(policy):
    origin = policy.posttune_origin
    engine = start_engine("builtin", None, EnginePolicy(origin.family, origin.build_kwargs, model=policy, version=4))
    out = engine.generate(PROMPTS, SAMPLING, SEEDS)
    assert out.token_lists() == expected(policy) and out.logprobs.dtype == torch.float32
    engine.update_weights(None, 5)  # the live model moved on: nothing to copy
    assert engine.version == 5 and engine.model is policy
    engine.close()


def test_without_a_live_policy_it_builds_one_and_takes_the_weights_it_is_given(policy):
    origin = policy.posttune_origin
    engine = start_engine("builtin", {}, EnginePolicy(origin.family, origin.build_kwargs, version=-1))
    assert engine.version == -1 and engine.model is not policy  # no weights yet: a caller must not use it
    engine.update_weights(policy.state_dict(), 3)
    assert engine.version == 3
    assert engine.generate(PROMPTS, SAMPLING, SEEDS).token_lists() == expected(policy)


def test_weights_that_do_not_fit_are_one_line(policy):
    origin = policy.posttune_origin
    engine = start_engine("builtin", None, EnginePolicy(origin.family, origin.build_kwargs, version=-1))
    with pytest.raises(PosttuneError, match=r"^generation engine 'builtin': the weights do not fit its model "
                                            r"\(missing \[.*\], unexpected \['head.weight'\]\)$"):
        engine.update_weights({"head.weight": torch.zeros(1)}, 1)
    assert engine.version == -1


@pytest.mark.parametrize(("setting", "value"), [("temperature", -1.0), ("top_k", 0), ("top_p", 0.0),
                                                ("min_p", 1.5)])
def test_sampling_settings_out_of_range_are_refused_when_made(setting, value):
    with pytest.raises(SamplingError, match=f"^{setting} must be "):
        Sampling(8, **{setting: value})
    assert Sampling(8, stop_token_ids=[2, 3]).stop_token_ids == (2, 3)  # any iterable, kept as a tuple


def test_no_prompts_says_what_a_method_does_with_an_empty_share(policy):
    """A rank whose share of the last batch of prompts is empty (prompt_loader gives it an empty batch) must still
    generate, or the other ranks' collective forwards wait for it: the error says so, not only that it is empty."""
    origin = policy.posttune_origin
    engine = start_engine("builtin", None, EnginePolicy(origin.family, origin.build_kwargs, model=policy))
    with pytest.raises(ValueError, match=r"^generate_batch needs at least one prompt \(a rank's share of an epoch's "
                                         r"last batch of prompts may be empty: generate for a placeholder prompt"):
        engine.generate([], SAMPLING)


def test_complete_starts_the_engine_on_a_loaded_model_and_closes_it(policy, register_plugin):
    """`complete` (posttune generate, sample prompts, scripts) is the engine's generate on that model: the same
    completions as the loop, seeded per row; the engine it started is told to take the model's weights first (one
    with its own copy would otherwise generate with its checkpoint's) and closed after (a recording engine says so)."""
    from posttune.plugin import GenerationEngine, complete, hookimpl

    calls = []

    class Recorded:
        def __init__(self, policy):
            self.inner = start_engine("builtin", None, policy)
            self.version = self.inner.version

        def generate(self, prompts, sampling, seeds=None):
            calls.append(("generate", policy_of(self.inner), tuple(seeds)))
            return self.inner.generate(prompts, sampling, seeds)

        def update_weights(self, weights, version):
            calls.append(("update", weights))
            self.inner.update_weights(weights, version)

        def close(self):
            calls.append(("close",))
            self.inner.close()

    def policy_of(inner):
        return inner.model is policy

    class Plugin:
        POSTTUNE_PLUGIN_API = 2

        @hookimpl
        def posttune_register_generation_engines(self, register):
            register(GenerationEngine("recorded", Recorded))

    register_plugin(Plugin(), name="recorded", distribution="posttune-recorded")
    assert complete(policy, PROMPTS, SAMPLING, seeds=SEEDS).token_lists() == expected(policy)
    assert complete(policy, PROMPTS, SAMPLING, seeds=SEEDS, engine="recorded").token_lists() == expected(policy)
    assert calls == [("update", None), ("generate", True, tuple(SEEDS)), ("close",)]  # refreshed from the model


def test_without_posttune_generate_generation_is_refused_in_one_line_naming_it(tmp_path, register_plugin,
                                                                              posttune_cli):
    """The core has no engine and no `posttune generate` (posttune-generate's command): the command is unknown, and a
    run's `train.sample_prompts` is refused at validate, each naming the distribution to install."""
    import yaml

    from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    save_tiny_hf_checkpoint(tmp_path / "model", tiny_llama_config(), seed=0)
    result = posttune_cli("generate", "--model", str(tmp_path / "model"), "--prompt", "hi")
    [line] = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and line.startswith("posttune: error: no command 'generate' is installed (installed: ")
    assert line.endswith(" — pip install posttune-generate")
    import posttune_sft

    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    config = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": [{"path": str(rows)}]},
              "train": {"max_steps": 1, "sample_prompts": ["hi"]},
              "checkpoint": {"output_dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(tmp_path / "run.yaml"))
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "posttune: error: config: train.sample_prompts: no generation engine 'builtin' is installed (installed: none) "
        "— pip install posttune-generate"]
