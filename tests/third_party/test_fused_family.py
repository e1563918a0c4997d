"""Converters map tensors one-to-many and many-to-one, streamed, with no core change.

A third-party Phi-3 family (posttune_thirdparty/fused_family.py) splits transformers' fused
``qkv_proj`` and ``gate_up_proj`` into posttune's separate projections on load and joins them back
on save; a per-expert layout stacked into one native tensor (defined here) goes the other way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import posttune
from posttune.errors import PosttuneError
from posttune.plugin import CheckpointConverter, Join, ModelFamily
from posttune.plugins import hookimpl
from posttune_thirdparty import fused_family


class FusedFamilyPlugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_model_families(self, register):
        fused_family.register_model_families(register)

    @hookimpl
    def posttune_register_checkpoint_converters(self, register):
        fused_family.register_checkpoint_converters(register)


@pytest.fixture
def phi3(register_plugin, tmp_path):
    """transformers' tiny random Phi3ForCausalLM (GQA 4:2, RoPE base 5000) saved under tmp_path/hf."""
    from transformers import Phi3Config, Phi3ForCausalLM

    import posttune_generate

    import posttune_lora

    register_plugin(FusedFamilyPlugin(), name="thirdparty-fused", distribution="posttune-thirdparty")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    model = Phi3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_a_fused_checkpoint_loads_split_with_transformers_logits(phi3):
    reference, path = phi3
    model = posttune.load_model(path, dtype="float32")
    names = dict(model.named_parameters())
    assert names["layers.0.attn.q_proj.weight"].shape == (64, 64)  # 4 query heads of 16
    assert names["layers.0.attn.k_proj.weight"].shape == names["layers.0.attn.v_proj.weight"].shape == (32, 64)
    assert names["layers.0.mlp.gate_proj.weight"].shape == names["layers.0.mlp.up_proj.weight"].shape == (96, 64)
    assert not any("qkv" in name or "gate_up" in name for name in names)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf_logits(reference), atol=1e-4, rtol=0)


@pytest.mark.parametrize("max_shard_size", ["5GB", 40_000], ids=["one-file", "sharded"])
def test_saving_joins_the_parts_into_the_checkpoint_transformers_wrote(phi3, tmp_path, max_shard_size):
    from transformers import Phi3ForCausalLM

    reference, path = phi3
    out = posttune.save_model(posttune.load_model(path, dtype="float32"), tmp_path / "out",
                              max_shard_size=max_shard_size)
    saved = {key: value for file in sorted(out.glob("*.safetensors")) for key, value in load_file(file).items()}
    original = load_file(path / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[key], original[key]) for key in original)  # bitwise, fused rows in order
    assert (len(list(out.glob("*.safetensors"))) > 1) == (max_shard_size != "5GB")
    torch.testing.assert_close(hf_logits(Phi3ForCausalLM.from_pretrained(out).eval()), hf_logits(reference),
                               atol=1e-4, rtol=0)


def test_a_fused_tensor_of_the_wrong_size_is_one_line(phi3):
    _, path = phi3
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = torch.zeros(130, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PosttuneError) as caught:
        posttune.load_model(path)
    assert str(caught.value) == (f"{path}: checkpoint tensor 'model.layers.1.self_attn.qkv_proj.weight' has 130 rows; "
                                 "config.json's sizes give 64 + 32 + 32")


def test_a_peft_adapter_on_a_fused_family_is_written_on_the_fused_modules(phi3, tmp_path):
    """The core writes a join's parts' adapters as one adapter of the fused module (no family code):
    here q/k/v of rank 2 as one qkv_proj adapter of rank 6, which PEFT applies to transformers' model."""
    import peft

    from posttune.adapters import save_adapter
    from posttune_lora.layer import apply_lora

    reference, path = phi3
    model = posttune.load_model(path, dtype="float32")
    apply_lora(model, targets=["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"], rank=2, alpha=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    out = save_adapter(model.eval(), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["target_modules"], config["rank_pattern"], config["alpha_pattern"]) == (
        ["o_proj", "qkv_proj"], {"qkv_proj": 6}, {"qkv_proj": 12})
    base = hf_logits(reference)
    applied = peft.PeftModel.from_pretrained(reference, out).eval()  # injects into reference
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), applied(IDS).logits, atol=1e-4, rtol=0)
        assert (model(IDS) - base).abs().max() > 1e-3  # the adapters change the model


# A per-expert layout: the checkpoint holds model.layers.L.experts.E.weight [dim, dim], the model one
# stacked layers.L.weight [experts, dim, dim] per layer. Loading joins (many-to-one), saving splits.
LAYERS, EXPERTS, DIM = 2, 4, 3
EXPERT = re.compile(r"model\.layers\.(\d+)\.experts\.(\d+)\.weight")


class StackedExperts(nn.Module):
    def __init__(self, num_hidden_layers: int, num_experts: int, hidden_size: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(num_hidden_layers))
        for layer in self.layers:
            layer.weight = nn.Parameter(torch.empty(num_experts, hidden_size, hidden_size))


class ExpertsPlugin:
    """Registers the family with a converter that records what it converts and joins, in order."""

    POSTTUNE_PLUGIN_API = 2

    def __init__(self):
        self.events: list[str] = []

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if not parts[0].is_meta:
            self.events.append(f"join {len(parts)}")
        return torch.stack(parts)

    def to_native(self, key, tensor, config):
        layer, _ = EXPERT.fullmatch(key).groups()
        if not tensor.is_meta:  # the pre-check converts meta tensors from the headers first
            self.events.append(f"read {key}")
        parts = tuple(f"model.layers.{layer}.experts.{e}.weight" for e in range(config["num_experts"]))
        return Join(f"layers.{layer}.weight", parts, join=self.join), tensor

    def from_native(self, key, tensor, config):
        layer = key.split(".")[1]
        return ((f"model.layers.{layer}.experts.{e}.weight", tensor[e]) for e in range(len(tensor)))

    @hookimpl
    def posttune_register_model_families(self, register):
        register(ModelFamily("experts", ("StackedExpertsForCausalLM",), from_hf_config=lambda config: {
            key: config[key] for key in ("num_hidden_layers", "num_experts", "hidden_size")}, build=StackedExperts))

    @hookimpl
    def posttune_register_checkpoint_converters(self, register):
        register(CheckpointConverter("experts", "hf", to_native=self.to_native, from_native=self.from_native))


@pytest.fixture
def experts(register_plugin):
    plugin = ExpertsPlugin()
    register_plugin(plugin, name="thirdparty-experts", distribution="posttune-thirdparty")
    return plugin


def per_expert(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{layer}.experts.{e}.weight": torch.randn(DIM, DIM, generator=generator)
            for layer in range(LAYERS) for e in range(EXPERTS)}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """The tensors in ``shards`` files, dealt out in turn (so a layer's experts lie in several)."""
    path.mkdir()
    config = {"architectures": ["StackedExpertsForCausalLM"], "num_hidden_layers": LAYERS, "num_experts": EXPERTS,
              "hidden_size": DIM, "vocab_size": 16, "num_attention_heads": 1}
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {key: names[i % shards] for i, key in enumerate(tensors)}
    for name in names:
        save_file({k: v for k, v in tensors.items() if weight_map[k] == name}, path / name, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("shards", [1, 3])
def test_per_expert_tensors_load_stacked_into_one(experts, tmp_path, shards):
    tensors = per_expert()
    model = posttune.load_model(write_checkpoint(tmp_path / "ckpt", tensors, shards))
    for layer in range(LAYERS):
        expected = torch.stack([tensors[f"model.layers.{layer}.experts.{e}.weight"] for e in range(EXPERTS)])
        assert torch.equal(model.layers[layer].weight, expected)


def test_a_stack_is_made_as_soon_as_its_last_part_is_read(experts, tmp_path):
    """Streamed: layer 0's parts are joined (and let go) before any part of layer 1 is read."""
    posttune.load_model(write_checkpoint(tmp_path / "ckpt", per_expert()))
    layer = [f"read model.layers.0.experts.{e}.weight" for e in range(EXPERTS)]
    assert experts.events == [*layer, "join 4", *[event.replace("layers.0", "layers.1") for event in layer], "join 4"]


def test_a_stacked_tensor_saves_as_one_tensor_per_expert(experts, tmp_path):
    tensors = per_expert()
    out = posttune.save_model(posttune.load_model(write_checkpoint(tmp_path / "ckpt", tensors)), tmp_path / "out")
    saved = load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(tensors)
    assert all(torch.equal(saved[key], tensors[key]) for key in tensors)


def test_a_stack_missing_a_part_names_it_before_anything_is_allocated(experts, tmp_path):
    tensors = per_expert()
    del tensors["model.layers.1.experts.2.weight"]
    path = write_checkpoint(tmp_path / "ckpt", tensors)
    with pytest.raises(PosttuneError) as caught:
        posttune.load_model(path)
    assert str(caught.value) == (f"{path}: the checkpoint is incomplete: tensor 'layers.1.weight' is joined from "
                                 "4 parts; missing 'model.layers.1.experts.2.weight'")
    assert not any(event.startswith("read") for event in experts.events)  # found from the headers alone
