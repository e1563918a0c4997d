"""``adapter.targets`` in either naming: posttune's native module names (``output``, ``attn.q_proj``) or the
checkpoint's Hugging Face ones (``lm_head``, ``self_attn.q_proj``), which PEFT configs and posttune's own
``adapter_config.json`` hold. Users paste those; they must select what PEFT would select with them."""

from __future__ import annotations

import json

import posttune_generate

import posttune_lora
import pytest
import torch
from run_support import compose_run, sft_config
from torch import nn

import posttune
from posttune.adapters import adapted_modules, init_adapters, load_adapter, save_adapter
from posttune_lora.layer import apply_lora
from posttune.checkpoint.module_names import checkpoint_module_names
from posttune.errors import PosttuneError


def tiny_llama() -> nn.Module:
    """A random tiny Llama built from its size (no checkpoint: the HF names come from ``to_hf_config``)."""
    torch.manual_seed(0)
    return posttune.build_model("llama", "tiny", vocab_size=384)


def adapt(model: nn.Module, targets: list[str]) -> list[str]:
    """As a run injects ``adapter.targets``: with the checkpoint's module names as aliases."""
    return apply_lora(model, targets=targets, rank=2, alpha=4, aliases=checkpoint_module_names(model))


def adapted_by(targets: list[str]) -> list[str]:
    return adapt(tiny_llama(), targets)


def test_the_hugging_face_head_name_adapts_the_output_layer_in_a_run(tmp_path):
    session = compose_run(sft_config(tmp_path, adapter={"rank": 2, "alpha": 4, "targets": ["lm_head"]}))
    assert list(adapted_modules(session.model)) == ["output"]


@pytest.mark.parametrize("hf_targets, native_targets", [
    (["self_attn.q_proj", "v_proj"], ["attn.q_proj", "attn.v_proj"]),  # dotted suffixes, as in PEFT configs
    (["model.layers.1.self_attn.o_proj", "lm_head"], ["layers.1.attn.o_proj", "output"]),  # full names
    (["self_attn.*"], ["attn.*"]),  # posttune's globs work over either naming
])
def test_hugging_face_names_select_the_layers_native_names_do(hf_targets, native_targets):
    assert adapted_by(hf_targets) == adapted_by(native_targets)


def test_a_fused_hugging_face_module_selects_the_native_layers_it_holds():
    torch.manual_seed(0)
    chosen = adapt(posttune.build_model("phi3", "tiny"), ["qkv_proj"])
    assert chosen == [f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkv"]


def test_both_namings_mixed_select_the_union():
    assert adapted_by(["lm_head", "attn.k_proj"]) == ["layers.0.attn.k_proj", "layers.1.attn.k_proj", "output"]


def test_a_saved_adapters_target_modules_pasted_back_select_the_same_layers(tmp_path):
    model = tiny_llama()
    chosen = apply_lora(model, targets=["attn.q_proj", "layers.1.mlp.down_proj", "output"], rank=2, alpha=4)
    init_adapters(model)
    save_adapter(model, tmp_path / "adapter")
    pasted = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert "lm_head" in pasted and "output" not in pasted  # the file holds Hugging Face names
    again = tiny_llama()
    assert adapt(again, pasted) == chosen
    init_adapters(again)
    assert load_adapter(again, tmp_path / "adapter") == chosen  # what adapter.init_from checks


def test_a_run_starts_from_a_saved_adapter_with_its_target_modules_pasted(tmp_path):
    model = tiny_llama()
    apply_lora(model, targets=["q_proj", "output"], rank=2, alpha=4)
    init_adapters(model)
    save_adapter(model, tmp_path / "adapter")
    pasted = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    adapter = {"rank": 2, "alpha": 4, "targets": pasted, "init_from": str(tmp_path / "adapter")}
    session = compose_run(sft_config(tmp_path / "run", adapter=adapter))
    assert list(adapted_modules(session.model)) == ["layers.0.attn.q_proj", "layers.1.attn.q_proj", "output"]


def test_a_miss_lists_every_linear_layer_in_both_namings_head_included():
    with pytest.raises(PosttuneError) as info:
        adapted_by(["lm_headx"])
    message = str(info.value)
    assert "target 'lm_headx' matches no linear layer" in message and "\n" not in message
    assert "more" not in message
    assert "layers.*.attn.q_proj (self_attn.q_proj)" in message
    assert "layers.*.mlp.down_proj," in message  # spelled the same in both namings: said once
    assert message.endswith("output (lm_head))")


class Plain(nn.Module):
    """A model posttune did not build: no family, no converter, native names only."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(4, 4)}) for _ in range(2))
        self.output = nn.Linear(4, 8)


def test_a_model_without_a_converter_takes_native_names_only():
    assert checkpoint_module_names(Plain()) == {}
    assert adapt(Plain(), ["output"]) == ["output"]
    with pytest.raises(PosttuneError) as info:
        adapt(Plain(), ["lm_head"])
    assert str(info.value).endswith("(linear layers: layers.*.proj, output)")


def test_all_linear_selects_what_peft_selects_on_the_same_checkpoint(tmp_path):
    """PEFT's ``target_modules="all-linear"``, pasted as ``adapter.targets: all-linear``: every linear layer but
    the output head, compared with what PEFT itself wraps in the transformers model of the same checkpoint."""
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    names = checkpoint_module_names(model)
    transformers = pytest.importorskip("transformers")
    posttune.save_model(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    wrapped = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    peft_names = {name.removeprefix("base_model.model.") for name, module in wrapped.named_modules()
                  if hasattr(module, "lora_A") and isinstance(module.lora_A, nn.ModuleDict)}
    chosen = adapt(model, "all-linear")
    assert "output" not in chosen and len(chosen) == 2 * 7  # q, k, v, o, gate, up, down in two layers
    assert {names[name] for name in chosen} == peft_names


def test_all_linear_is_a_run_configs_targets_and_other_strings_are_refused(tmp_path):
    session = compose_run(sft_config(tmp_path, adapter={"rank": 2, "alpha": 4, "targets": "all-linear"}))
    assert "output" not in adapted_modules(session.model) and len(adapted_modules(session.model)) == 14
    with pytest.raises(PosttuneError, match="targets must be a non-empty list of module-name patterns or "
                                            "'all-linear', got 'q_proj'"):
        adapt(tiny_llama(), "q_proj")


def test_all_linear_on_a_mixture_of_experts_is_refused_where_peft_would_adapt_more():
    """PEFT's all-linear adapts a Mixtral's routers and stacked experts, which LoRA here does not: refused."""
    torch.manual_seed(0)
    with pytest.raises(PosttuneError) as info:
        adapt(posttune.build_model("mixtral", "tiny"), "all-linear")
    assert str(info.value).startswith("adapters: targets 'all-linear' on a mixture of experts "
                                      "(layers.*.mlp.experts.gate_proj): PEFT's all-linear also adapts the routers")


def test_validate_refuses_a_listed_target_the_model_lacks_before_launch(tmp_path, posttune_cli, register_plugin):
    """A mistyped target is one line from `posttune validate` (and plan, train), checked on the model built on the
    meta device: not a run that stops when it builds the model. A model from the hub is checked by the run."""
    import posttune_llama
    import posttune_sft
    from run_support import write

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    config = sft_config(tmp_path, adapter={"rank": 2, "alpha": 4, "targets": ["q_proj", "vproj"]})
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("posttune: error: config: adapter.targets: target 'vproj' matches no linear "
                                    "layer (linear layers: layers.*.attn.q_proj (self_attn.q_proj), "), result.stderr
    assert "output (lm_head))" in result.stderr
    config["adapter"]["targets"] = ["q_proj", "self_attn.v_proj"]
    assert posttune_cli("validate", str(write(tmp_path, config))).exit_code == 0


def test_save_merged_with_an_adapted_tied_head_is_refused_before_launch(tmp_path, posttune_cli, register_plugin):
    """Merging an adapter into a head the embedding shares would change the embedding too: with save_merged the
    run would have failed at its final save, after training. The adapter alone is fine (PEFT loads it)."""
    import posttune_llama
    import posttune_sft
    from run_support import write

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    config = sft_config(tmp_path, adapter={"rank": 2, "alpha": 4, "targets": ["q_proj", "lm_head"]},
                        model={"build_overrides": {"vocab_size": 384, "tie_word_embeddings": True}},
                        checkpoint={"save_merged": True})
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert (result.exit_code, result.stderr) == (2, (
        "posttune: error: config: checkpoint.save_merged: adapter.targets adapts 'output', whose weight the embedding "
        "shares (tied embeddings): merging would change the embedding too; leave it out of adapter.targets, or save "
        "the adapter alone\n"))
    config["checkpoint"]["save_merged"] = False
    assert posttune_cli("validate", str(write(tmp_path, config))).exit_code == 0
    config["checkpoint"]["save_merged"] = True
    config["model"]["build_overrides"]["tie_word_embeddings"] = False  # an untied head merges
    assert posttune_cli("validate", str(write(tmp_path, config))).exit_code == 0
