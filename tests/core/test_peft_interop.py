"""Adapters made by the peft library itself on transformers models, loaded by posttune through `posttune merge` and
``adapter.init_from``: the result must compute what ``peft.PeftModel`` computes (fp32, 1e-5).

Phi-3's ``qkv_proj``/``gate_up_proj`` are split into q/k/v and gate/up in posttune: PEFT's dense adapter on a fused
layer becomes one adapter per part (its rows of B, a copy of A; DoRA's magnitude by rows). A targeted ``lm_head``
makes PEFT save the head's base weight beside the adapter: checked against the base, never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from run_support import compose_run, sft_config
from safetensors.torch import load_file, save_file

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_phi3
import posttune_sft
from posttune.testing.tiny import TINY, tiny_hf_model, tiny_llama_config

TOL = 1e-5
FUSED = ["qkv_proj", "gate_up_proj", "o_proj"]
HEAD_KEY = "base_model.model.lm_head.base_layer.weight"
OPTIONS = {"lora": {}, "dora": {"use_dora": True}, "rslora": {"use_rslora": True}}


@pytest.fixture
def families(register_plugin):
    """The families `posttune merge` reads and the method of an ``init_from`` run, in the isolated plugin set."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_phi3, distribution="posttune-phi3", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def base_checkpoint(path: Path, config: transformers.PreTrainedConfig) -> Path:
    tiny_hf_model(config).save_pretrained(path)
    return path


def hf_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def peft_adapter(base: Path, folder: Path, targets: list[str], **options) -> peft.PeftModel:
    """PEFT's adapter (rank 4, alpha 8) on the base, with random B and DoRA magnitudes as after training, saved."""
    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **options))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "magnitude" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))


def assert_peft_logits(theirs: peft.PeftModel, ours: torch.Tensor, base: Path) -> None:
    with torch.no_grad():
        expected = theirs(ids()).logits
        torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)
        assert (hf_model(base)(ids()).logits - expected).abs().max() > 0.1  # the adapter matters


def merged_logits(posttune_cli, adapter: Path, out: Path) -> torch.Tensor:
    result = posttune_cli("merge", "--adapter", str(adapter), "-o", str(out))
    assert result.exit_code == 0, result.stderr
    with torch.no_grad():
        return hf_model(out)(ids()).logits


def init_from_logits(tmp_path: Path, base: Path, adapter: Path, **options) -> torch.Tensor:
    """A run's model starting from ``adapter`` (``adapter.init_from``), as `posttune train` composes it."""
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    section = {"rank": 4, "alpha": 8, "targets": sorted(targets), "init_from": str(adapter),
               "kind": "dora" if options.get("use_dora") else "lora", "rslora": bool(options.get("use_rslora"))}
    config = sft_config(tmp_path / "run", adapter=section)
    config["model"] = {"path": str(base)}
    session = compose_run(config)
    with torch.no_grad():
        return session.model.eval()(ids())


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_peft_adapter_on_phi3_fused_layers_merges_and_inits_to_peft_logits(families, posttune_cli, tmp_path, kind):
    """Before: refused with "'model.layers.0.mlp.gate_up_proj' has rank 4 and alpha 8 after rank_pattern/alpha_pattern;
    expected fused from 2 layers". PEFT's dense rank-r adapter on qkv_proj is q/k/v adapters of rank r sharing A."""
    base = base_checkpoint(tmp_path / "base", transformers.Phi3Config(**TINY))
    theirs = peft_adapter(base, tmp_path / "adapter", FUSED, **OPTIONS[kind])
    assert_peft_logits(theirs, merged_logits(posttune_cli, tmp_path / "adapter", tmp_path / "merged"), base)
    assert_peft_logits(theirs, init_from_logits(tmp_path, base, tmp_path / "adapter", **OPTIONS[kind]), base)


def test_peft_adapter_on_lm_head_merges_and_inits_to_peft_logits(families, posttune_cli, tmp_path):
    """Before: refused with "tensor 'base_model.model.lm_head.base_layer.weight' belongs to no adapter"."""
    base = base_checkpoint(tmp_path / "base", tiny_llama_config())
    theirs = peft_adapter(base, tmp_path / "adapter", ["q_proj", "lm_head"])
    assert HEAD_KEY in load_file(tmp_path / "adapter" / "adapter_model.safetensors")  # save_embedding_layers="auto"
    assert_peft_logits(theirs, merged_logits(posttune_cli, tmp_path / "adapter", tmp_path / "merged"), base)
    assert_peft_logits(theirs, init_from_logits(tmp_path, base, tmp_path / "adapter"), base)


def test_a_peft_head_copy_that_is_not_the_bases_head_is_refused_in_one_line(families, posttune_cli, tmp_path):
    """PEFT loads that copy over the model's head, so it would compute with another head than the base's."""
    base = base_checkpoint(tmp_path / "base", tiny_llama_config())
    peft_adapter(base, tmp_path / "adapter", ["q_proj", "lm_head"])
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors[HEAD_KEY] = tensors[HEAD_KEY] + 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    result = posttune_cli("merge", "--adapter", str(tmp_path / "adapter"), "-o", str(tmp_path / "merged"))
    assert result.exit_code == 2
    assert result.stderr == (f"posttune: error: {weights}: '{HEAD_KEY}', PEFT's copy of the base layer (which PEFT "
                             "loads over the model's), differs from this model's: the adapter was saved on another "
                             "base (or a resized vocabulary); load it on that one\n")


@pytest.mark.parametrize("config", [{"target_modules": "all-linear"}, {"target_modules": ["q_proj", "v_proj"]},
                                    {"target_modules": r".*\.mlp\..*_proj"},
                                    {"target_modules": "all-linear", "exclude_modules": ["o_proj", "up_proj"]}],
                         ids=["all-linear", "list", "regex", "exclude"])
def test_target_modules_select_the_layers_peft_adapts(config):
    """PEFT's own ``get_peft_model`` on the transformers model is the reference: ``all-linear`` leaves the output
    head out, list entries are names or dotted suffixes, a string a full regex."""
    from posttune_lora.peft_format import peft_targets_match

    model = transformers.LlamaForCausalLM(tiny_llama_config())
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, **config))
    theirs = {name.removeprefix("base_model.model.").removesuffix(".base_layer")
              for name, _ in wrapped.named_modules() if name.endswith(".base_layer")}
    assert {name for name in linear if peft_targets_match(config, name)} == theirs


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_up_proj",
                                  "model.layers.1.self_attn.qkv_proj", "model.layers.10.self_attn.q_proj", "lm_head"])
def test_rank_and_alpha_patterns_pick_the_key_peft_picks(name):
    """A pattern key matches as a dotted-suffix regex (``up_proj`` is not ``gate_up_proj``'s), the first that
    matches wins: PEFT's ``get_pattern_key``."""
    from peft.utils.other import get_pattern_key

    from posttune_lora.peft_format import _pattern_value

    patterns = {"up_proj": 8, r"layers\.1\..*": 16, "q_proj": 2}
    key = get_pattern_key(patterns.keys(), name)
    assert _pattern_value(patterns, name, 4) == patterns.get(key, 4)
