"""A third-party adapter kind (``ia3``, posttune_thirdparty/ia3.py) trains through `posttune train`, saves a
folder PEFT loads with the same logits, resumes exactly, merges (`posttune merge`), runs under
`posttune generate --adapter` and trains on 2 gloo ranks under fsdp2 like one process: with posttune-lora not
registered, so the core does all of it through the adapter protocol alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import posttune_generate
import posttune_llama
import posttune_sft
import pytest
import torch
from install_support import install
from run_support import metrics, save_hf_teacher, sft_config, write

import posttune
from posttune.adapters import adapted_modules, load_adapter
from posttune.plugins import hookimpl
from posttune_thirdparty import ia3

#: layers whose rows the Llama converter keeps in place (q/k are RoPE-permuted: refused by the kind)
TARGETS = ["attn.v_proj", "attn.o_proj", "mlp.down_proj"]
PROMPT = [[1, 40, 41, 42, 43, 44, 45, 46]]


class IA3Plugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_adapter_kinds(self, register):
        ia3.register_adapter_kinds(register)


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")  # posttune-sft's dependency
    register_plugin(IA3Plugin(), name="thirdparty-ia3", distribution="posttune-thirdparty", version="0.1.0")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama written by transformers (hidden 96, 2 layers, vocab 384): what the adapter is trained on."""
    return save_hf_teacher(tmp_path_factory.mktemp("base") / "llama")


def run_config(tmp_path: Path, base: Path, **sections) -> Path:
    sections = {"adapter": {"kind": "ia3", "targets": TARGETS}, "train": {"max_steps": 6, "lr": 2e-2}, **sections}
    config = sft_config(tmp_path, **sections)
    config["model"] = {"path": str(base)}
    return write(tmp_path, config)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor(PROMPT))
    return getattr(out, "logits", out).float()


def test_a_run_trains_the_kind_and_peft_computes_what_posttune_does(plugins, posttune_cli, base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = posttune_cli("train", str(run_config(tmp_path, base)))
    assert result.exit_code == 0, result.stderr
    adapter = tmp_path / "out" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "IA3"
    assert config["target_modules"] == [f"model.layers.{i}.{m}" for i in range(2)  # Hugging Face names
                                        for m in ("mlp.down_proj", "self_attn.o_proj", "self_attn.v_proj")]
    assert (adapter / "tokenizer.json").is_file() and not (tmp_path / "out" / "model").exists()
    assert [record["step"] for record in metrics(tmp_path / "out") if "loss" in record] == [1, 2, 3, 4, 5, 6]

    ours = posttune.load_model(str(base))
    assert sorted(load_adapter(ours, adapter)) == sorted(f"layers.{i}.{m}" for i in range(2) for m in TARGETS)
    scales = torch.cat([layer.ia3_l.detach() for layer in adapted_modules(ours).values()])
    assert (scales - 1).abs().max() > 1e-3  # it trained: the scales left their initial ones
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    torch.testing.assert_close(logits(ours.eval()), logits(peft), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(ours), logits(posttune.load_model(str(base)).eval()), atol=1e-3)


def test_merge_and_generate_read_the_folder_through_its_kind(plugins, posttune_cli, base, tmp_path):
    assert posttune_cli("train", str(run_config(tmp_path, base))).exit_code == 0
    adapter, merged = tmp_path / "out" / "adapter", tmp_path / "merged"
    result = posttune_cli("merge", "--adapter", str(adapter), "-o", str(merged))
    assert result.exit_code == 0, result.stderr
    adapted = posttune.load_model(str(base))
    load_adapter(adapted, adapter)
    plain = posttune.load_model(str(merged))
    assert not adapted_modules(plain)
    torch.testing.assert_close(logits(plain.eval()), logits(adapted.eval()), atol=1e-5, rtol=0)
    generated = posttune_cli("generate", "--adapter", str(adapter), "--prompt", "Reverse: AB", "--max-new-tokens", "3")
    assert generated.exit_code == 0, generated.stderr


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(plugins, posttune_cli, base, tmp_path):
    whole = run_config(tmp_path / "whole", base)
    assert posttune_cli("train", str(whole)).exit_code == 0
    parts = run_config(tmp_path / "parts", base, checkpoint={"output_dir": str(tmp_path / "parts" / "out"),
                                                             "save_every": 3})
    assert posttune_cli("train", str(parts), "train.max_steps=3").exit_code == 0
    resumed = posttune_cli("train", str(parts), "checkpoint.resume=latest")
    assert resumed.exit_code == 0, resumed.stderr
    from safetensors.torch import load_file

    want = load_file(tmp_path / "whole" / "out" / "adapter" / "adapter_model.safetensors")
    got = load_file(tmp_path / "parts" / "out" / "adapter" / "adapter_model.safetensors")
    assert want.keys() == got.keys()
    for key in want:  # the same machine: bit for bit
        assert torch.equal(got[key], want[key]), key


def test_kinds_are_listed_and_a_kind_not_installed_is_named_with_its_distribution(plugins, posttune_cli, base,
                                                                                   tmp_path):
    listed = posttune_cli("ls", "adapters")
    assert listed.exit_code == 0 and "ia3" in listed.stdout and "posttune-thirdparty" in listed.stdout
    assert "lora" not in listed.stdout
    refused = posttune_cli("validate", str(run_config(tmp_path, base)), "adapter.kind=lora")
    assert refused.exit_code == 2
    assert "adapter.kind: no adapter kind 'lora' is installed" in refused.stderr
    assert "pip install posttune-lora" in refused.stderr
    wrong = posttune_cli("validate", str(run_config(tmp_path, base)), "adapter.loraplus_lr_ratio=16")
    assert wrong.exit_code == 2 and "adapter.loraplus_lr_ratio: ia3 has no B matrices" in wrong.stderr


@pytest.mark.slow
def test_two_fsdp2_ranks_train_the_kind_like_one_process(base, tmp_path):
    """The adapters' gather for a save and their sharded resume go through the protocol (tensors outside
    ``base``): 2 gloo ranks of 4 rows each under fsdp2 save the scales one process of 8 rows trains, to float
    rounding."""
    from safetensors.torch import load_file

    env = install(tmp_path / "site")
    runs = {}
    for name, rows, launch in (("single", 8, ()), ("fsdp2", 4, ("--nproc-per-node", "2", "--standalone"))):
        config = run_config(tmp_path / name, base, train={"max_steps": 4, "lr": 2e-2, "batch_size": rows},
                            parallel={"plans": ["fsdp2"]})
        command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), *launch]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        runs[name] = load_file(tmp_path / name / "out" / "adapter" / "adapter_model.safetensors")
    assert runs["fsdp2"].keys() == runs["single"].keys()
    for key, tensor in runs["single"].items():
        torch.testing.assert_close(runs["fsdp2"][key], tensor, atol=1e-5, rtol=0, msg=key)
