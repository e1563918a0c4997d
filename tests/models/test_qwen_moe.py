"""qwen2_moe and qwen3_moe match transformers: logits, the load-balancing loss, greedy generation,
and checkpoints both ways (per-expert HF tensors stacked on load, split again on save).

docs/moe.md; the blocks themselves are pinned in tests/core/test_moe_blocks.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

import posttune
from posttune.errors import PosttuneError
from posttune_generate import generate
from posttune.testing.tiny import TINY, tiny_hf_model

FP32_TOLERANCE = 1e-4
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**{**TINY, "head_dim": 32, **MOE, "norm_topk_prob": True}),
    # a dense layer among the experts, as Qwen3's mlp_only_layers allows
    "qwen3_moe_mlp_only": lambda: transformers.Qwen3MoeConfig(**{**TINY, "head_dim": 32, **MOE, "num_hidden_layers": 3,
                                                                 "mlp_only_layers": [1]}),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**{**TINY, **MOE, "shared_expert_intermediate_size": 48}),
    # experts on every second layer only
    "qwen2_moe_sparse_step": lambda: transformers.Qwen2MoeConfig(**{**TINY, **MOE, "decoder_sparse_step": 2,
                                                                    "shared_expert_intermediate_size": 48,
                                                                    "norm_topk_prob": True}),
}


def _tokens(seq: int = 24, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (the HF model, its save_pretrained directory)."""
    out = {}
    for name, config in CONFIGS.items():
        hf_model = tiny_hf_model(config())
        path = tmp_path_factory.mktemp(name)
        hf_model.save_pretrained(path)
        out[name] = hf_model, path
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_aux_loss_match_transformers(saved, name):
    hf_model, path = saved[name]
    model = posttune.load_model(path).train()
    ids = _tokens()
    with torch.no_grad():
        expected = hf_model(ids, output_router_logits=True)
    got = model(ids)
    assert (got - expected.logits).abs().max().item() <= FP32_TOLERANCE
    loss, metrics = model.aux_loss()
    assert abs(metrics["aux_loss"].item() - expected.aux_loss.item()) <= 1e-6
    assert loss.item() == pytest.approx(hf_model.config.router_aux_loss_coef * expected.aux_loss.item(), rel=1e-6)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_dense_and_moe_layers_are_where_transformers_puts_them(saved, name):
    hf_model, path = saved[name + ("_mlp_only" if name == "qwen3_moe" else "_sparse_step")]
    model = posttune.load_model(path)
    expected = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_model.model.layers]
    assert [type(layer.mlp).__name__ == "MoE" for layer in model.layers] == expected
    assert True in expected and False in expected


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_greedy_generation_matches_transformers(name):
    config = CONFIGS[name]()
    config.initializer_range = 0.2  # see test_qwen_generation: the layers, not the embedding, pick tokens
    config.eos_token_id = 511  # a token these seeds never pick: every one of the 16 steps is compared
    hf_model = tiny_hf_model(config)
    prompt = [5, 17, 300, 42, 7, 99]
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=config.eos_token_id, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 16 and len(set(expected)) >= 6
    model = _native(hf_model)
    assert generate(model, prompt, max_new_tokens=16, eos_token_ids=(config.eos_token_id,)) == expected


def _native(hf_model, tmp=None):
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        return posttune.load_model(path)


@pytest.mark.parametrize("name", ["qwen3_moe_mlp_only", "qwen2_moe"])
def test_saved_checkpoint_loads_in_transformers_with_per_expert_tensors(saved, name, tmp_path):
    hf_model, path = saved[name]
    posttune.save_model(posttune.load_model(path), tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    with safe_open(path / "model.safetensors", "pt") as f:
        assert keys == set(f.keys())  # the same per-expert names transformers wrote
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids = _tokens()
    with torch.no_grad():
        assert (reloaded(ids).logits - hf_model(ids).logits).abs().max().item() <= 1e-5
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == hf_model.config.architectures
    assert (reloaded.config.num_experts_per_tok == 2
            and reloaded.config.mlp_only_layers == hf_model.config.mlp_only_layers)


def _edit_config(path, tmp_path, **changes):
    import shutil

    target = tmp_path / "edited"
    shutil.copytree(path, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be between 1 and num_experts"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers must list layer indices below 2"),
    ({"moe_intermediate_size": None}, "'moe_intermediate_size' is missing"),
])
def test_bad_moe_fields_are_refused_in_one_line(saved, tmp_path, changes, message):
    """At load, and before launch (`posttune validate` reads a local config.json as the family does)."""
    from posttune.config import validate
    from posttune.errors import ConfigError
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    path = _edit_config(saved["qwen3_moe"][1], tmp_path, **changes)
    with pytest.raises(PosttuneError, match=message) as caught:
        posttune.load_model(path)
    assert "\n" not in str(caught.value)
    config = validate({"model": {"path": str(path)}, "method": "sft", "data": {"train": {"path": "rows.jsonl"}}})
    with pytest.raises(ConfigError, match=message) as refused:
        resolve_plan(config, get_registry())
    assert str(refused.value).startswith(f"config: model.path: {path}: config.json")


def test_a_qwen2_moe_without_its_shared_expert_is_refused_before_its_empty_tensors(saved, tmp_path):
    """transformers builds shared_expert_intermediate_size 0 as empty tensors plus a gate, and saves them: said
    as the setting it is, not as unexpected tensors of a damaged checkpoint."""
    path = _edit_config(saved["qwen2_moe"][1], tmp_path, shared_expert_intermediate_size=0)
    with pytest.raises(PosttuneError, match="shared_expert_intermediate_size 0 .no shared expert. is not supported"):
        posttune.load_model(path)


def test_a_missing_expert_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _edit_config(saved["qwen3_moe"][1], tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PosttuneError, match="model.layers.1.mlp.experts.3.up_proj.weight"):
        posttune.load_model(path)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_tiny_sizes_build_and_route(family):
    model = posttune.build_model(family, "tiny").train()
    model(torch.randint(0, 512, (2, 8)))
    loss, metrics = model.aux_loss()
    assert torch.isfinite(loss) and metrics["expert_tokens_mean"].item() == pytest.approx(2 * 8 * 2 / 8)


@pytest.mark.parametrize("target", ["layers.*.mlp.experts", "experts.gate_proj", "layers.0.mlp.experts.down_proj"])
def test_lora_on_stacked_experts_is_refused_with_the_reason(target):
    from posttune_lora.layer import apply_lora

    model = posttune.build_model("qwen3_moe", "tiny")
    with pytest.raises(PosttuneError, match=rf"^adapters: target '{target}' names stacked expert weights "
                                            r"\(layers\.\*\.mlp\.experts\.\w+\), which adapters do not adapt yet"):
        apply_lora(model, targets=["attn.q_proj", target])


@pytest.mark.parametrize("target", ["mlp.gate", "mlp.experts.0.gate_proj"])
def test_a_peft_recipes_router_or_per_expert_target_is_told_they_take_no_adapter(target):
    from posttune_lora.layer import apply_lora

    model = posttune.build_model("qwen3_moe", "tiny")
    with pytest.raises(PosttuneError) as refused:
        apply_lora(model, targets=[target])
    assert str(refused.value).startswith(f"adapters: target '{target}' matches no linear layer")
    assert str(refused.value).endswith("; on this mixture of experts the routers and the stacked experts "
                                       "(layers.*.mlp.experts.gate_proj, Hugging Face's mlp.gate and mlp.experts.N.*) "
                                       "take no adapter yet (docs/moe.md)")


def test_default_lora_targets_adapt_attention_and_shared_experts():
    from posttune.adapters import adapted_modules
    from posttune.plugin import lookup
    from posttune_lora.layer import apply_lora

    for family, shared in (("qwen3_moe", False), ("qwen2_moe", True)):
        model = posttune.build_model(family, "tiny")
        apply_lora(model, targets=lookup("model_family", family).lora_targets)
        names = {name.split(".", 2)[2] for name in adapted_modules(model)}
        expected = {f"attn.{p}_proj" for p in "qkvo"} | ({f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}
                                                        if shared else set())
        assert names == expected
