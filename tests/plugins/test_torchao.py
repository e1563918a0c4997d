"""posttune-torchao: NF4 base weights (QLoRA), low-bit AdamW, QAT export, refusals before launch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
import transformers
import yaml
from memory_support import compose_run, sft_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
import posttune_torchao
from posttune.descriptors import ParallelPlan
from posttune.plugins import module_plugin
from posttune.training import save_final
from posttune.training.trainer import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def stand_in_plans(register):
    for name in ("loss_parallel", "tp", "fsdp2"):
        register(ParallelPlan(name, lambda session: None))


@pytest.fixture
def plugins(register_plugin, posttune_plugins):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")
    register_plugin(posttune_torchao, distribution="posttune-torchao", version="0.1.0")
    register_plugin(module_plugin("stand_in_plans", posttune_register_parallel_plans=stand_in_plans),
                    distribution="posttune-stand-in")
    return posttune_plugins.registry


def nf4_weights(model):
    from torchao.quantization.quantize_.workflows import NF4Tensor

    return {n: p for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}


def test_qlora_stores_base_weights_as_nf4_and_trains_the_adapters(plugins, tmp_path):
    from posttune_torchao.low_bit_optim import tensor_bytes

    config = sft_config(tmp_path, adapter={"rank": 4, "alpha": 8}, memory=["qlora_nf4"],
                        train={"max_steps": 3, "lr": 1e-2}, checkpoint={"save_merged": True})
    session = compose_run(config)
    quantized = nf4_weights(session.model)
    assert len(quantized) == 2 * 7  # every q/k/v/o/gate/up/down base of both layers
    nf4 = sum(tensor_bytes(w) for w in quantized.values())
    dense = sum(w.numel() * 4 for w in quantized.values())
    assert nf4 < 0.15 * dense, (nf4, dense)  # 4-bit codes + scales, against fp32
    codes = {n: w.quantized_data.clone() for n, w in quantized.items()}
    adapters = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    train(session)
    assert all(torch.equal(nf4_weights(session.model)[n].quantized_data, c) for n, c in codes.items())
    moved = [n for n, p in session.model.named_parameters() if p.requires_grad and not torch.equal(p, adapters[n])]
    assert any("lora_B" in n for n in moved)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        expected = session.model(ids)  # NF4 base + adapters, as trained
    save_final(session)
    assert not nf4_weights(session.model)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").eval()
    with torch.no_grad():
        logits = merged(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_qlora_saves_its_adapter_without_dequantising_the_base(plugins, tmp_path):
    """The whole base went back to the training dtype before every final save, asked to merge or not: on one
    GPU, Mixtral's dense copy is past the memory the 4-bit run fits in."""
    session = compose_run(sft_config(tmp_path, adapter={"rank": 4, "alpha": 8}, memory=["qlora_nf4"],
                                     train={"max_steps": 1}))
    train(session)
    quantized = len(nf4_weights(session.model))
    save_final(session)
    assert quantized and len(nf4_weights(session.model)) == quantized  # still NF4 after the save
    saved = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    trained = {n: p for n, p in session.model.named_parameters() if p.requires_grad and "lora_B" in n}
    assert len([key for key in saved if "lora_B" in key]) == len(trained) > 0


# both are torchao's low-bit AdamW behind one wrapper: tox -e extended runs the 8-bit one too
@pytest.mark.parametrize(("technique", "most"), [pytest.param("adamw_8bit", 0.4, marks=pytest.mark.extended),
                                                 ("adamw_4bit", 0.25)])
def test_low_bit_adamw_state_is_smaller_and_resumes_exactly(plugins, tmp_path, technique, most):
    from posttune_torchao.low_bit_optim import state_bytes

    steps = {"max_steps": 2, "weight_decay": 0.01}
    sizes = {}
    for memory in ([], [technique]):
        session = compose_run(sft_config(tmp_path / (memory[0] if memory else "adamw"), train=steps, memory=memory,
                                         checkpoint={"save_every": 1}))
        train(session)
        sizes[technique if memory else "adamw"] = state_bytes(session.optimizer)
    print(f"optimizer state bytes: {sizes}")
    assert sizes[technique] < most * sizes["adamw"]
    whole = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    saved = tmp_path / technique / "out" / "checkpoints" / "step-00000001"
    resumed = compose_run(sft_config(tmp_path / "resumed", train=steps, memory=[technique],
                                     checkpoint={"resume": str(saved)}))
    assert type(resumed.optimizer).__name__ == type(session.optimizer).__name__
    train(resumed)
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, whole[name], atol=0, rtol=0, msg=name)


def test_qat_trains_fake_quantised_and_exports_int4_grid_weights(plugins, tmp_path):
    from torchao.quantization.qat import FakeQuantizedLinear

    config = sft_config(tmp_path, memory=["qat"], memory_options={"qat": {"group_size": 32}},
                        train={"max_steps": 2})
    session = compose_run(config)
    fake = [n for n, m in session.model.named_modules() if isinstance(m, FakeQuantizedLinear)]
    assert len(fake) == 2 * 7
    train(session)
    save_final(session)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    weight = exported.model.layers[0].self_attn.q_proj.weight.detach()
    groups = weight.reshape(weight.shape[0], -1, 32)
    distinct = max(len(torch.unique(group)) for row in groups for group in row)
    assert distinct <= 16  # int4: at most 16 levels per group of 32
    assert len(torch.unique(exported.lm_head.weight)) > 16  # the head is not quantised


def cli_validate(posttune_cli, tmp_path, **sections):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path, **sections)))
    return posttune_cli("validate", str(path))


def test_every_conflicting_pair_is_refused_by_validate_naming_both(plugins, posttune_cli, tmp_path):
    plans = set(plugins.entries["parallel_plan"])
    pairs = sorted({(name, other) for name, item in plugins.entries["memory_technique"].items()
                    for other in item.descriptor.conflicts})
    assert {("adamw_8bit", "optimizer_in_backward"), ("qlora_nf4", "qat"), ("qat", "fp8")} <= set(pairs)
    for name, other in pairs:
        result = cli_validate(posttune_cli, tmp_path, adapter={"rank": 4},
                              memory=[name] + ([] if other in plans else [other]),
                              parallel={"plans": [other]} if other in plans else {})
        lines = result.stderr.strip().splitlines()
        assert result.exit_code != 0, (name, other)
        assert len(lines) == 1 and f"'{name}'" in lines[0] and f"'{other}'" in lines[0], lines


@pytest.mark.parametrize(("sections", "expected"), [
    ({"memory": ["qlora_nf4"]}, "adapter: qlora_nf4 stores the frozen base weights as NF4"),
    ({"memory": ["qlora_nf4"], "adapter": {"kind": "dora"}}, "adapter.kind: qlora_nf4 supports kind 'lora'"),
    ({"memory": ["adamw_8bit"], "train": {"optimizer": "sgd"}}, "train.optimizer: adamw_8bit replaces"),
    ({"memory": ["fp8"], "train": {"device": "cpu"}}, "'fp8' needs a CUDA device"),
])
def test_impossible_settings_are_refused_in_one_line(plugins, posttune_cli, tmp_path, sections, expected):
    result = cli_validate(posttune_cli, tmp_path, **sections)
    assert result.exit_code != 0
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_qlora_stores_a_mixture_of_experts_stacked_experts_as_nf4(plugins, register_plugin, tmp_path):
    import posttune_qwen
    from posttune_torchao.qlora import unpack_nf4

    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    config = sft_config(tmp_path, adapter={"rank": 4, "alpha": 8}, memory=["qlora_nf4"],
                        train={"max_steps": 2, "lr": 1e-2}, checkpoint={"save_merged": True})
    config["model"] = {"family": "qwen3_moe", "size": "tiny", "build_overrides": {"vocab_size": 384}}
    session = compose_run(config)
    quantized = nf4_weights(session.model)
    stacks = sorted(n for n in quantized if ".mlp.experts." in n)
    assert stacks == sorted(f"layers.{i}.mlp.experts.{p}_proj" for i in range(2) for p in ("gate", "up", "down"))
    experts = session.model.layers[0].mlp.experts
    dense = unpack_nf4(experts.num_experts, experts.gate_proj)
    assert dense.shape == (8, 32, 64)  # [experts, intermediate, hidden] for the compute
    train(session)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        expected = session.model(ids)  # NF4 experts and attention bases + adapters, as trained
    save_final(session)
    assert not nf4_weights(session.model) and session.model.layers[0].mlp.experts.unpack is None
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_importing_torchao_prints_nothing_about_kernels_nothing_here_uses():
    """torchao's import warns of its MX / CUTLASS-fp8 GPU kernels failing to load (CPU-only machines, some torch
    builds) and torch of a deprecated enum registration: noise before every QLoRA run, filtered by the plugin."""
    result = subprocess.run([sys.executable, "-c", "import posttune_torchao, torchao, torchao.quantization, peft"],
                            capture_output=True, text=True, check=True)
    assert "_C_mxfp8" not in result.stderr and "_C_cutlass_90a" not in result.stderr, result.stderr
    assert "Enum subclass" not in result.stderr, result.stderr
