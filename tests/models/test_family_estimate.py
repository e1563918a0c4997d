"""`posttune plan` estimates the activations of a family whose layers hold an MLP of its own (here one
that keeps a checkpoint's fused ``gate_up_proj``), not only of ``posttune.modules``' GatedMLP."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
import yaml
from run_support import TOKENIZER
from torch import nn

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
from posttune import hookimpl


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one Linear, as Phi-3 stores them."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


def build(**kwargs):
    model = posttune_llama.LLAMA.build(**kwargs)
    for layer in model.layers:
        layer.mlp = FusedMLP(kwargs["hidden_size"], kwargs["intermediate_size"])
    return model


class OwnMLPFamily:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_model_families(self, register):
        register(replace(posttune_llama.LLAMA, name="own_mlp", architectures=("OwnMLPForCausalLM",), build=build))


def plan_output(posttune_cli, tmp_path, family: str) -> str:
    rows = [{"text": "a b c d e f"}] * 4
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "model": {"family": family, "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": TOKENIZER}, "method": "sft",
        "data": {"train": {"path": str(tmp_path / "train.jsonl"), "format": "text"}, "max_seq_len": 64},
        "train": {"epochs": 1, "batch_size": 2, "device": "cpu"},
        "checkpoint": {"output_dir": str(tmp_path / "out")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("plan", str(tmp_path / "run.yaml"))
    assert result.exit_code == 0, result.stderr
    return result.stdout


def test_a_family_with_its_own_mlp_gets_the_activations_of_the_same_shape(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(OwnMLPFamily(), name="own-mlp", distribution="own-mlp")
    own = plan_output(posttune_cli, tmp_path, "own_mlp")
    assert "no decoder layers" not in own
    activations = [line for line in own.splitlines() if line.strip().startswith("activations")]
    llama = plan_output(posttune_cli, tmp_path, "llama")
    assert activations and activations == [line for line in llama.splitlines()
                                           if line.strip().startswith("activations")]
