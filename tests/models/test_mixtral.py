"""Mixtral (posttune-llama's ``mixtral`` family) against transformers' MixtralForCausalLM, through real
checkpoint files: logits, the load-balancing loss, greedy generation, saving back, and the
config.json values posttune refuses.

Transformers 5 keeps each layer's experts fused in memory (``mlp.experts.gate_up_proj``) and
writes them per expert (``block_sparse_moe.experts.E.w1``) only in ``save_pretrained``, so every
native model here comes from a saved checkpoint, the format the converter serves.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import posttune
import posttune_llama
import posttune_generate
import posttune_lora
from logits import IDS, assert_close, native_logits, transformers_logits
from posttune_generate import generate
from posttune.plugin import PosttuneError
from posttune.testing.tiny import TINY, tiny_hf_model
from posttune_llama.config import MIXTRAL_DEFAULTS
from posttune_llama.model import build_mixtral

PROMPT = [5, 17, 300, 42, 7, 99]
#: 8 experts of width 32, 2 per token; the sliding variant attends over 8 of IDS' 24 tokens
CONFIGS = {"full": {}, "sliding_window": {"sliding_window": 8}}


def tiny_mixtral_config(**overrides) -> transformers.MixtralConfig:
    return transformers.MixtralConfig(**{**TINY, "num_local_experts": 8, "num_experts_per_tok": 2,
                                         "intermediate_size": 32, **overrides})


def save_tiny(path: Path, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random tiny Mixtral (norms perturbed) written with ``save_pretrained``."""
    hf_model = tiny_hf_model(tiny_mixtral_config(**overrides), seed=seed)
    hf_model.save_pretrained(path)
    return hf_model


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.fixture(autouse=True)
def llama_plugin(register_plugin):
    register_plugin(posttune_llama, name="llama", distribution="posttune-llama")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name, tmp_path):
    reference = save_tiny(tmp_path / "hf", **CONFIGS[name])
    model = posttune.load_model(tmp_path / "hf")
    assert model.layers[0].attn.sliding_window == CONFIGS[name].get("sliding_window")
    assert_close(native_logits(model), transformers_logits(reference))


def test_aux_loss_is_transformers_load_balancing_loss(tmp_path):
    reference = save_tiny(tmp_path / "hf", router_aux_loss_coef=0.02)
    model = posttune.load_model(tmp_path / "hf").train()
    model(IDS)  # with grad: the routing is recorded
    weighted, metrics = model.aux_loss()
    expected = reference(IDS, output_router_logits=True).aux_loss
    assert abs(metrics["aux_loss"].item() - expected.item()) <= 1e-6
    assert weighted.item() == (0.02 * metrics["aux_loss"]).item()  # config.json's router_aux_loss_coef
    weighted.backward()
    assert model.layers[0].mlp.router.weight.grad.abs().sum() > 0  # the loss trains the router
    with torch.no_grad():
        model(IDS)
    assert model.aux_loss() is None  # a forward without a graph (a reference, generation) records nothing


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_matches_transformers(name, tmp_path):
    # a wide init lets the layers (and the router), not the embedding alone, pick each next token; at
    # seed 1 neither variant emits eos in 8 tokens, and the window changes the tokens from the 4th on
    reference = save_tiny(tmp_path / "hf", seed=1, initializer_range=0.2, **CONFIGS[name])
    model = posttune.load_model(tmp_path / "hf")
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=2,
                                  pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(expected) == 8 and len(set(expected)) >= 4  # no eos, no loop: every step is compared
    assert generate(model, PROMPT, max_new_tokens=8, eos_token_ids=(2,)) == expected


def test_saved_checkpoint_has_per_expert_tensors_and_loads_in_transformers(tmp_path):
    save_tiny(tmp_path / "hf")
    model = posttune.load_model(tmp_path / "hf")
    posttune.save_model(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
    experts = {f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
               for layer in range(2) for expert in range(8) for w in ("w1", "w2", "w3")}
    assert experts <= keys and not any("gate_proj" in key or "mlp." in key for key in keys)
    assert "model.layers.1.block_sparse_moe.gate.weight" in keys
    logits = transformers_logits(tmp_path / "out")
    assert (logits - native_logits(model)).abs().max().item() <= 1e-5


def test_named_size_builds_runs_and_saves_as_a_transformers_checkpoint(tmp_path):
    model = posttune.build_model("mixtral", "tiny").eval()
    assert native_logits(model).shape == (*IDS.shape, 512)
    posttune.save_model(model, tmp_path / "out")  # config.json from the family's to_hf_config
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["router_jitter_noise"] == 0.0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert isinstance(hf_model, transformers.MixtralForCausalLM)
    assert_close(transformers_logits(tmp_path / "out"), native_logits(model))


@pytest.mark.parametrize("fields, named", [
    ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_local_experts": None}, "num_local_experts"),
    ({"router_aux_loss_coef": "0.02"}, "router_aux_loss_coef"),
])
def test_unbuildable_routing_is_refused_in_one_line(fields, named, tmp_path):
    save_tiny(tmp_path / "hf")
    edit_config(tmp_path / "hf", **fields)
    with pytest.raises(PosttuneError) as refused:
        posttune.load_model(tmp_path / "hf")
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("size", posttune_llama.MIXTRAL.sizes)
def test_every_size_survives_config_json_both_ways(size):
    family, kwargs = posttune_llama.MIXTRAL, posttune_llama.MIXTRAL.sizes[size]
    assert family.from_hf_config(family.to_hf_config(kwargs)) == kwargs


def test_released_size_has_the_released_parameter_count():
    """Mixtral-8x7B: 46,702,792,704 parameters (32 layers of attention, 8 experts, router and norms)."""
    with torch.device("meta"):
        model = posttune_llama.MIXTRAL.build(**posttune_llama.MIXTRAL.sizes["8x7b"])
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704


def test_absent_fields_default_as_mixtral_config_and_as_the_builder():
    """A config.json without the fields MixtralConfig defaults reads as transformers reads it, and
    ``to_hf_config`` writes the builder's defaults for kwargs a size leaves out."""
    config = {**tiny_mixtral_config().to_dict()}
    for field in ("rope_parameters", "rope_theta", "rms_norm_eps", "max_position_embeddings"):
        config.pop(field, None)
    kwargs = posttune_llama.MIXTRAL.from_hf_config(config)
    assert (kwargs["rope_theta"], kwargs["norm_eps"], kwargs["max_position_embeddings"]) == (1e6, 1e-5, 131072)
    defaults = {name: p.default for name, p in inspect.signature(build_mixtral).parameters.items()
                if p.default is not inspect.Parameter.empty and name in MIXTRAL_DEFAULTS}
    assert defaults == MIXTRAL_DEFAULTS


def test_lora_targets_and_tp_plan_name_attention_only():
    model = posttune.build_model("mixtral", "tiny")
    names = [name for name, _ in model.named_modules()]
    targets = [name for name in names if any(fnmatch.fnmatch(name, t) for t in posttune_llama.MIXTRAL.lora_targets)]
    assert len(targets) == 2 * 4 and all(".attn." in name for name in targets)
    plan = posttune_llama.MIXTRAL.tp_plan
    assert not any(".mlp." in pattern for pattern in plan)  # the router and experts stay whole
    assert all(any(fnmatch.fnmatch(name, pattern) for name in names) for pattern in plan)
