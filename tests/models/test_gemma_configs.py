"""Every config posttune-gemma bundles validates, and SFT trains a tiny Gemma 2 through the gemma chat template."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml

import posttune
import posttune_gemma
import posttune_generate
import posttune_lora
import posttune_sft
from posttune.config import load_config, validate
from posttune.losses import IGNORE_INDEX
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.training.compose import compose
from posttune.training.metrics import read_metrics

NAMES = sorted(path.stem for path in posttune_gemma.CONFIGS.glob("*.yaml"))


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_gemma, distribution="posttune-gemma", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def test_every_family_has_full_and_lora_configs():
    assert {"gemma-7b-lora", "gemma2-2b-sft", "gemma2-9b-lora", "gemma3-1b-sft", "gemma3-1b-lora"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_bundled_config_validates_and_shows_its_command(plugins, posttune_cli, name):
    text = (posttune_gemma.CONFIGS / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == f"# posttune train {name}"
    result = posttune_cli("validate", name)
    assert result.exit_code == 0, result.stderr
    assert name in posttune_cli("ls", "configs").stdout


CHATS = [
    [{"role": "user", "content": "Reverse: ABC"}, {"role": "assistant", "content": "CBA"},
     {"role": "user", "content": "Reverse: hello"}, {"role": "assistant", "content": "olleh"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}],
] * 6


@pytest.fixture
def gemma2_run(tmp_path):
    """A tiny Gemma 2 SFT config (soft-capping and an 8-token window active) with the gemma tokenizer."""
    tokenizer = save_tiny_tokenizer(tmp_path / "tokenizer", template="start_of_turn")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    config = {
        "model": {"family": "gemma2", "size": "tiny", "build_overrides": {
            "vocab_size": 384, "num_layers": 3, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}},
        "tokenizer": {"path": str(tokenizer)},
        "method": {"name": "sft"},
        "data": {"train": {"path": str(train), "format": "chat"}, "max_seq_len": 64},
        "train": {"epochs": 2, "batch_size": 4, "lr": 3e-3, "seed": 0},
        "checkpoint": {"output_dir": str(tmp_path / "out")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_sft_labels_only_the_assistant_turns_of_the_gemma_template(plugins, gemma2_run):
    session = compose(resolve_plan(validate(load_config(gemma2_run, [])), get_registry()))
    tokenizer = transformers.AutoTokenizer.from_pretrained(gemma2_run.parent / "tokenizer")
    trained = []
    for batch in session.train_data:  # padding-free: one row, a document per sample
        documents = batch["document_ids"][0]
        for doc in documents.unique().tolist():
            ids, labels = batch["input_ids"][0][documents == doc], batch["labels"][0][documents == doc]
            targets = labels[labels != IGNORE_INDEX].tolist()
            if targets:  # the row's tail padding (a document without targets) has none
                trained.append(tokenizer.decode(targets))
            assert labels[:-1][labels[:-1] != IGNORE_INDEX].tolist() == ids[1:][labels[:-1] != IGNORE_INDEX].tolist()
    assert sorted(set(trained)) == ["CBA<end_of_turn>olleh<end_of_turn>", "Paris.<end_of_turn>"]


def test_sft_trains_a_tiny_gemma2_end_to_end(plugins, posttune_cli, gemma2_run):
    result = posttune_cli("train", str(gemma2_run))
    assert result.exit_code == 0, result.stderr
    out = gemma2_run.parent / "out"
    records = read_metrics(out)
    assert records[-1]["loss"] < records[0]["loss"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out / "model", attn_implementation="eager").eval()
    assert type(hf_model).__name__ == "Gemma2ForCausalLM"
    ids = torch.randint(0, 384, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (posttune.load_model(out / "model")(ids) - hf_model(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_lora_on_a_tiny_gemma3_saves_an_adapter_and_a_merged_model_transformers_loads(plugins, posttune_cli,
                                                                                     gemma2_run):
    config = yaml.safe_load(gemma2_run.read_text())
    config["model"] = {"family": "gemma3", "size": "tiny", "build_overrides": {"vocab_size": 384}}
    config["adapter"] = {"kind": "lora", "rank": 4, "alpha": 8}
    config["train"].update(max_steps=3, lr=1e-2)
    config["checkpoint"]["save_merged"] = True
    gemma2_run.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(gemma2_run))
    assert result.exit_code == 0, result.stderr
    out = gemma2_run.parent / "out"
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "model", attn_implementation="eager").eval()
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, 384, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (posttune.load_model(out / "model")(ids) - merged(ids).logits).abs().max().item() <= 1e-4
