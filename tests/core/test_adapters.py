"""LoRA / DoRA adapters on a toy model: injection by name, training, disabling, merging, PEFT files.

The toy model has the native naming shape (``layers.N.attn.q_proj``...) but no family: these
tests hold for any model. Llama parity with transformers + peft lives in tests/models.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from posttune.adapters import (
    adapted_key,
    adapter_state_dict,
    adapters_disabled,
    base_key,
    init_adapters,
    load_adapter,
    merge_adapters,
    save_adapter,
    trainable_parameters,
)
from posttune_lora.layer import LoRALinear, apply_lora
from posttune.checkpoint.materialize import materialize
from posttune.checkpoint.origin import ModelOrigin, attach
from posttune.descriptors import CheckpointConverter, ModelFamily
from posttune.errors import PosttuneError
from posttune.plugins import hookimpl

DIM, VOCAB = 8, 16
IDS = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.attn.v_proj = nn.Linear(DIM, DIM // 2, bias=True)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(DIM // 2, 2 * DIM)
        self.mlp.down_proj = nn.Linear(2 * DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        x = x + self.attn.q_proj(x) + self.mlp.down_proj(torch.tanh(self.mlp.up_proj(self.attn.v_proj(x))))
        return self.norm(x)


class Toy(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def toy(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy().eval()


def randomize(model: nn.Module, seed: int = 1) -> None:
    """Give every adapter tensor random values, so that adapters change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in adapter_state_dict(model).items():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3 + (1.0 if "magnitude" in key else 0))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


ALL = ["q_proj", "v_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_fresh_adapter_leaves_the_output_unchanged(kind):
    model = toy()
    before = logits(model)
    apply_lora(model, targets=ALL + ["output"], rank=4, alpha=8, kind=kind)
    assert torch.allclose(logits(model), before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_an_optimizer_step_changes_only_adapter_parameters(kind):
    model = toy().train()
    apply_lora(model, targets=ALL, rank=4, alpha=8, dropout=0.1, kind=kind)
    randomize(model)
    adapters = set(adapter_state_dict(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(IDS).logsumexp(-1).mean().backward()
    optimizer.step()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k not in adapters)
    assert all(not torch.equal(before[k], after[k]) for k in adapters)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters


def test_adapters_disabled_gives_the_base_output_and_restores_them():
    model = toy()
    base = logits(model)
    apply_lora(model, targets=ALL, rank=2, alpha=4, kind="dora")
    randomize(model)
    adapted = logits(model)
    assert not torch.allclose(adapted, base, atol=1e-3)
    with adapters_disabled(model):
        assert torch.equal(logits(model), base)
    assert torch.equal(logits(model), adapted)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merge_folds_adapters_into_plain_linear_layers(kind):
    model = toy()
    keys = list(model.state_dict())
    apply_lora(model, targets=ALL, rank=3, alpha=5, kind=kind)
    randomize(model)
    adapted = logits(model)
    merged = merge_adapters(model)
    assert merged == [f"layers.{i}.{m}" for i in range(2) for m in ("attn.q_proj", "attn.v_proj",
                                                                       "mlp.up_proj", "mlp.down_proj")]
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert list(model.state_dict()) == keys
    assert torch.allclose(logits(model), adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_bf16_merge_does_not_depend_on_the_adapters_dtype(kind):
    """A bf16 run's adapters train in bf16; loaded for a merge they are fp32 (as PEFT loads them). The same values
    merge to the same weight either way: the update is computed and added in fp32, rounded to bf16 once."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48).to(torch.bfloat16)
    layers = [LoRALinear(base, rank=4, alpha=8, kind=kind, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)]
    for tensor in (layers[0].lora_B.weight, *([layers[0].magnitude] if kind == "dora" else [])):
        nn.init.normal_(tensor)
    with torch.no_grad():
        for name, tensor in layers[0].named_parameters():
            if not name.startswith("base."):
                layers[1].get_parameter(name).copy_(tensor)
    merged = [layer.merged_weight() for layer in layers]
    assert merged[0].dtype == torch.bfloat16 and torch.equal(merged[0], merged[1])
    exact = base.weight.float() + 2 * layers[1].lora_B.weight @ layers[1].lora_A.weight
    if kind == "lora":
        assert torch.equal(merged[0], exact.to(torch.bfloat16))


def test_dora_layer_computes_with_its_merged_weight():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(6, 5), rank=2, alpha=3, kind="dora")
    nn.init.normal_(layer.lora_B.weight)
    nn.init.normal_(layer.magnitude)
    x = torch.randn(4, 6)
    delta = 1.5 * layer.lora_B.weight @ layer.lora_A.weight
    v = layer.base.weight + delta
    expected = x @ (layer.magnitude[:, None] * v / v.norm(dim=1, keepdim=True)).T + layer.base.bias
    assert torch.allclose(layer(x), expected, atol=1e-5)


def test_state_dict_names_map_back_to_the_base_model():
    model = toy()
    base = list(model.state_dict())
    apply_lora(model, targets=["layers.0.attn.q_proj"], rank=2, alpha=2, kind="dora")
    state = list(model.state_dict())
    assert "layers.0.attn.q_proj.base.weight" in state
    assert sorted(adapter_state_dict(model)) == ["layers.0.attn.q_proj.lora_A.weight",
                                                 "layers.0.attn.q_proj.lora_B.weight",
                                                 "layers.0.attn.q_proj.magnitude"]
    assert [base_key(k) for k in state if k not in adapter_state_dict(model)] == base
    assert adapted_key("layers.0.attn.q_proj.weight", model) == "layers.0.attn.q_proj.base.weight"
    assert adapted_key("layers.1.attn.q_proj.weight", model) == "layers.1.attn.q_proj.weight"


@pytest.mark.parametrize("targets, expected", [
    (["layers.1.mlp.up_proj"], ["layers.1.mlp.up_proj"]),  # exact name
    (["attn.v_proj"], ["layers.0.attn.v_proj", "layers.1.attn.v_proj"]),  # dotted suffix
    (["layers.*.mlp.*"], ["layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.up_proj",
                          "layers.1.mlp.down_proj"]),  # glob over the full name
    (["q_*", "output"], ["layers.0.attn.q_proj", "layers.1.attn.q_proj", "output"]),  # glob over a suffix
])
def test_target_patterns(targets, expected):
    assert apply_lora(toy(), targets=targets, rank=2, alpha=2) == expected


def test_a_pattern_matching_no_linear_layer_is_a_one_line_error():
    with pytest.raises(PosttuneError) as info:
        apply_lora(toy(), targets=["q_proj", "qkv_proj"], rank=2, alpha=2)
    message = str(info.value)
    assert "'qkv_proj' matches no linear layer" in message
    assert "layers.*.attn.q_proj" in message and "\n" not in message
    with pytest.raises(PosttuneError, match="matches no linear layer"):
        apply_lora(toy(), targets=["norm"], rank=2, alpha=2)  # a module, but not a linear one


def test_trainable_parameter_counts():
    model = toy()
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, targets=["q_proj"], rank=2, alpha=2)
    lora = 2 * (2 * DIM + DIM * 2)  # two layers, A [2, 8] + B [8, 2]
    assert trainable_parameters(model) == (lora, total + lora)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_meta_build_then_inject_materialise_load_init(kind):
    reference = toy()
    with torch.device("meta"):
        torch.manual_seed(0)
        model = Toy().eval()
    apply_lora(model, targets=ALL, rank=2, alpha=4, kind=kind)
    with pytest.raises(PosttuneError, match="meta device"):
        init_adapters(model)
    materialize(model, "cpu")
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():  # what a checkpoint loader does
        state[adapted_key(key, model)].copy_(tensor)
    init_adapters(model)
    assert torch.allclose(logits(model), logits(reference), atol=1e-6, rtol=0)
    if kind == "dora":
        q = model.layers[0].attn.q_proj
        assert torch.allclose(q.magnitude, reference.layers[0].attn.q_proj.weight.norm(dim=1))


# --- the PEFT format, through a family whose converter renames and also permutes rows ---


def _to_hf(key: str) -> str:
    return "model." + key.replace("attn.", "self_attn.")


def _from_native(key, tensor, config):
    # Reversing q_proj's rows stands for a RoPE permutation: the adapter must follow it.
    return _to_hf(key), (tensor.flip(0) if key.endswith("q_proj.weight") else tensor)


def _to_native(key, tensor, config):
    native = key.removeprefix("model.").replace("self_attn.", "attn.")
    return native, (tensor.flip(0) if key.endswith("q_proj.weight") else tensor)


class ToyFamily:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_model_families(self, register):
        register(ModelFamily("toy", ("ToyForCausalLM",), dict, Toy, to_hf_config=lambda kw: {"model_type": "toy"}))

    @hookimpl
    def posttune_register_checkpoint_converters(self, register):
        register(CheckpointConverter("toy", "hf", _to_native, _from_native))


@pytest.fixture
def toy_family(register_plugin):
    import posttune_generate
    import posttune_lora

    register_plugin(ToyFamily(), name="toy", distribution="posttune-toy")
    register_plugin(posttune_lora, name="lora", distribution="posttune-lora")
    register_plugin(posttune_generate, name="generate", distribution="posttune-generate")


def toy_with_origin(seed: int = 0) -> Toy:
    model = toy(seed)
    attach(model, ModelOrigin("toy", {}, source="toy/base"))
    return model


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_files_round_trip_through_a_permuting_converter(toy_family, tmp_path, kind):
    model = toy_with_origin()
    apply_lora(model, targets=["q_proj", "layers.1.mlp.up_proj"], rank=2, alpha=3, dropout=0.05, kind=kind)
    randomize(model)
    save_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.1.mlp.up_proj", "q_proj"]
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["use_dora"]) == (2, 3, 0.05,
                                                                                              kind == "dora")
    assert (config["peft_type"], config["task_type"], config["base_model_name_or_path"]) == ("LORA", "CAUSAL_LM",
                                                                                          "toy/base")
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    q = model.layers[0].attn.q_proj
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert torch.equal(tensors[f"{prefix}.lora_B.weight"], q.lora_B.weight.flip(0))
    assert torch.equal(tensors[f"{prefix}.lora_A.weight"], q.lora_A.weight)
    if kind == "dora":
        assert torch.equal(tensors[f"{prefix}.lora_magnitude_vector"], q.magnitude.flip(0))

    fresh = toy_with_origin()
    assert load_adapter(fresh, tmp_path / "adapter") == ["layers.0.attn.q_proj", "layers.1.attn.q_proj",
                                                              "layers.1.mlp.up_proj"]
    assert torch.equal(logits(fresh), logits(model))
    assert load_adapter(fresh, tmp_path / "adapter")  # resume: same adapters, loaded again


@pytest.mark.parametrize("key, value, message", [
    ("lora_dropout", 1.5, "adapters: dropout must be in [0, 1), got 1.5"),
    ("r", 0, "adapters: rank must be a positive integer, got 0"),
    ("lora_alpha", -2, "adapters: alpha must be positive, got -2.0"),
])
def test_a_saved_folders_settings_are_checked_as_a_scripts_are(toy_family, tmp_path, key, value, message):
    """Loading a folder into a model without adapters applies them with the file's settings, checked as
    ``apply_lora`` checks a script's: one line, not a crash inside torch's layers."""
    model = toy_with_origin()
    apply_lora(model, targets=["q_proj"], rank=2, alpha=4)
    save_adapter(model, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(PosttuneError) as refused:
        load_adapter(toy_with_origin(), tmp_path / "adapter")
    assert str(refused.value) == message


def test_a_local_base_is_named_by_its_absolute_path_and_a_missing_one_in_one_line(toy_family, tmp_path,
                                                                                  monkeypatch):
    """`model.path: base` trains from the current folder; `generate --adapter` may run from any other."""
    from posttune.adapters import adapter_base

    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    model = toy(0)
    attach(model, ModelOrigin("toy", {}, source="base"))
    apply_lora(model, targets=["q_proj"], rank=2, alpha=4)
    save_adapter(model, tmp_path / "adapter")
    assert adapter_base(tmp_path / "adapter", "generate") == str(tmp_path / "base")
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "./gone"}))
    with pytest.raises(PosttuneError, match=r"^generate: --adapter .*/adapter: the base model its "
                                            r"adapter_config.json names, './gone', is no folder here .*give --model$"):
        adapter_base(tmp_path / "adapter", "generate")


def test_loading_a_mismatched_adapter_is_refused(toy_family, tmp_path):
    model = toy_with_origin()
    apply_lora(model, targets=["q_proj"], rank=2, alpha=2)
    save_adapter(model, tmp_path / "adapter")
    other = toy_with_origin()
    apply_lora(other, targets=["v_proj"], rank=2, alpha=2)
    with pytest.raises(PosttuneError, match="targets differ"):
        load_adapter(other, tmp_path / "adapter")
    with pytest.raises(PosttuneError, match="no adapter_config.json"):
        load_adapter(toy_with_origin(), tmp_path)
    with torch.device("meta"):
        meta = Toy()
    attach(meta, ModelOrigin("toy", {}))
    with pytest.raises(PosttuneError, match="meta device"):
        load_adapter(meta, tmp_path / "adapter")


def test_a_converter_that_mixes_columns_is_refused(toy_family, monkeypatch, tmp_path):
    model = toy_with_origin()
    apply_lora(model, targets=["q_proj"], rank=2, alpha=2)
    fake = SimpleNamespace(from_native=lambda k, t, c: (_to_hf(k), t.flip(1)), to_native=_to_native)
    monkeypatch.setattr("posttune_lora.peft_format.family_io", lambda m: (SimpleNamespace(source=None),
                                                                               fake, {}))
    with pytest.raises(PosttuneError, match="cannot follow"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
