"""A third-party memory technique brings its own term to `posttune plan`'s memory estimate
(tests/third_party/posttune_thirdparty/estimate_term.py): the core sums it like its own."""

from __future__ import annotations

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
import pytest
import yaml
from posttune import hookimpl
from posttune.config import validate
from posttune.estimate import estimate
from posttune.plan import resolve_plan
from posttune_thirdparty import estimate_term
from run_support import sft_config

EMBEDDING = 4096 * 64  # vocab x hidden of the tiny Llama below (its head is the same tensor: tied)


class ThirdParty:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_memory_techniques(self, register):
        estimate_term.register_memory_techniques(register)


@pytest.fixture
def plugins(register_plugin, posttune_plugins):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")
    register_plugin(ThirdParty(), name="thirdparty", distribution="posttune-thirdparty", version="0.1.0")
    return posttune_plugins.registry


def config(tmp_path, **sections):
    return sft_config(tmp_path, model={"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 4096}},
                      **sections)


def test_the_term_takes_the_embeddings_gradient_and_optimizer_state_out(plugins, tmp_path):
    plain = estimate(resolve_plan(validate(config(tmp_path / "a")), plugins))
    frozen = estimate(resolve_plan(validate(config(tmp_path / "b", memory=["frozen_embedding"])), plugins))
    before, after = plain.models[0], frozen.models[0]
    assert after.trainable == before.trainable - EMBEDDING
    assert after.gradient_bytes == before.gradient_bytes - 4 * EMBEDDING
    assert after.optimizer_bytes == before.optimizer_bytes - 2 * 4 * EMBEDDING  # AdamW's two fp32 states
    assert (after.weights_bytes, frozen.activations, frozen.logits) == (before.weights_bytes, plain.activations,
                                                                         plain.logits)
    assert frozen.unmodelled == ()


def test_terms_of_later_stages_see_the_embedding_frozen(plugins, tmp_path):
    """optimizer_in_backward (optimizer stage) keeps one gradient alive, the largest trainable tensor's:
    the embedding's (tied to the head) without frozen_embedding (adapt stage), a decoder matrix's with it,
    whichever order the config lists them in (terms apply in the run's stage order)."""
    train = {**config(tmp_path)["train"], "max_grad_norm": None}
    largest = {}
    for memory in (["optimizer_in_backward"], ["frozen_embedding", "optimizer_in_backward"],
                   ["optimizer_in_backward", "frozen_embedding"]):
        run = config(tmp_path / "-".join(memory), memory=memory, train=train)
        largest[tuple(memory)] = estimate(resolve_plan(validate(run), plugins)).models[0].gradient_bytes
    assert largest[("optimizer_in_backward",)] == 4 * EMBEDDING
    assert largest[("frozen_embedding", "optimizer_in_backward")] == 4 * 64 * 128  # hidden x intermediate
    assert largest[("optimizer_in_backward", "frozen_embedding")] == 4 * 64 * 128


def test_posttune_plan_prints_the_parts_with_the_term(plugins, posttune_cli, tmp_path):
    lines = {}
    for memory in ([], ["frozen_embedding"]):
        path = tmp_path / f"{len(memory)}.yaml"
        path.write_text(yaml.safe_dump(config(tmp_path / path.stem, memory=memory)))
        result = posttune_cli("plan", str(path))
        assert result.exit_code == 0, result.stderr
        lines[len(memory)] = result.stdout.splitlines()
    plain = estimate(resolve_plan(validate(config(tmp_path / "c")), plugins))
    assert f"parameters: {plain.parameters:,} ({plain.trainable - EMBEDDING:,} trainable)" in lines[1]
    assert "  policy: weights 1.3 MiB, gradients 1.3 MiB, optimizer 2.6 MiB" in lines[0]
    assert "  policy: weights 1.3 MiB, gradients 0.3 MiB, optimizer 0.6 MiB" in lines[1]  # 1 MiB embedding out
    assert not any("not modelled" in line for line in lines[1])
