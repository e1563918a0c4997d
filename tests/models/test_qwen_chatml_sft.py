"""SFT on a Qwen checkpoint that ships a ChatML template: the prompt is masked, end to end.

From a config file through the composed session (checkpoint, its own tokenizer and template,
data pipeline, model, SFT loss) the trained tokens must be exactly each assistant turn's
content and its ``<|im_end|>``, and the loss the SFT method computes must equal transformers'
own cross-entropy with those labels. The expected labels are built independently, the way
TRL masks completions: render the prompt with ``add_generation_prompt=True`` using
transformers' tokenizer and train on what the assistant turn adds after it.
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import transformers
import yaml

import posttune_generate

import posttune_lora
import posttune_qwen
import posttune_sft
from posttune.config import load_config, validate
from posttune.data import IGNORE_INDEX
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.testing.tiny import save_tiny_hf_checkpoint
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.training.compose import compose
from qwen_tiny import tiny_qwen2_config

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome, of course."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}],
]


@pytest.fixture
def session(register_plugin, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    checkpoint = tmp_path / "qwen"
    save_tiny_hf_checkpoint(checkpoint, tiny_qwen2_config(vocab_size=384))
    save_tiny_tokenizer(checkpoint, template="chatml")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    config = {"model": {"path": str(checkpoint)}, "method": {"name": "sft"},
              "data": {"train": {"path": str(data), "format": "chat"}, "max_seq_len": 128},
              "train": {"batch_size": 1, "epochs": 1, "seed": 0},
              "checkpoint": {"output_dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return compose(resolve_plan(validate(load_config(tmp_path / "run.yaml", [])), get_registry()))


def reference_labels(tokenizer, chat) -> tuple[list[int], list[int]]:
    """(ids, unshifted labels) as transformers users build them: -100 outside assistant turns."""
    def ids(messages, **kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    full = ids(chat)
    labels = [IGNORE_INDEX] * len(full)
    for turn, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        start = len(ids(chat[:turn], add_generation_prompt=True))
        answer = tokenizer(message["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        assert full[start:start + len(answer)] == answer
        labels[start:start + len(answer)] = answer
    return full, labels


def test_sft_trains_only_assistant_turns_and_matches_transformers_loss(session, tmp_path):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "qwen")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen", dtype=torch.float32).eval()
    batches = list(session.train_data)
    assert len(batches) == len(CHATS)
    seen = set()
    for batch in batches:
        ids = batch["input_ids"][0].tolist()
        chat = next(i for i, c in enumerate(CHATS) if reference_labels(hf_tokenizer, c)[0] == ids)
        seen.add(chat)
        _, labels = reference_labels(hf_tokenizer, CHATS[chat])
        assert batch["labels"][0].tolist() == labels[1:] + [IGNORE_INDEX]  # pre-shifted by the pipeline
        targets = [t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]
        assistant = [m["content"] + "<|im_end|>" for m in CHATS[chat] if m["role"] == "assistant"]
        assert hf_tokenizer.decode(targets) == "".join(assistant)

        with torch.no_grad():
            output = posttune_sft.loss(session, batch)
            expected = hf_model(torch.tensor([ids]), labels=torch.tensor([labels])).loss
        assert int(output.normaliser) == len(targets)
        assert int(output.tokens) == len(ids)  # what was processed: the whole chat
        torch.testing.assert_close(output.loss_sum / output.normaliser, expected, atol=1e-5, rtol=1e-5)
    assert seen == {0, 1}
