"""Packed and padded SFT batches give a tiny Llama the same loss as its documents run alone.

This is the contract between the data pipeline (pre-shifted labels, ``document_ids``) and the
model (attention within a document, positions restarting per document): packing changes speed,
never the loss.
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import torch.nn.functional as F

from posttune.config.schema import DataConfig, DatasetConfig
from posttune.data import IGNORE_INDEX
from posttune_sft import sft_loader as build_sft_loader
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

TOLERANCE = 1e-5
ROWS = [{"instruction": f"What is {i} + {i}?", "input": "Be brief." if i % 2 else "",
         "output": f"The answer is {2 * i}." + " Sure, here is the answer." * (i % 3)} for i in range(7)]


@pytest.fixture
def loader(tmp_path, monkeypatch):
    """``loader(packing, batch_size)`` over ROWS with a tiny chatml tokenizer (vocab 384 < the model's 512)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    tokenizer = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok", template="chatml"))
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    fmt = new_plugin_set().registry.get("dataset_format", "alpaca")

    def make(packing: bool, batch_size: int):
        dataset = DatasetConfig(path=str(path), format="alpaca")
        data = DataConfig(train=dataset, max_seq_len=200)
        return build_sft_loader(dataset, data=data, fmt=fmt, tokenizer=tokenizer, batch_size=batch_size,
                                shuffle=False, train_on_input=True, packing=packing, padding_free=False)

    return make


def summed_loss(model, batch) -> tuple[torch.Tensor, int]:
    """What an SFT method computes: summed CE over targets, no shifting, and the target count."""
    with torch.no_grad():
        logits = model(batch["input_ids"], document_ids=batch.get("document_ids"))
    labels = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, int((labels != IGNORE_INDEX).sum())


def alone(model, loader) -> list[tuple[torch.Tensor, int]]:
    """Each sample's summed loss and target count, one sample per forward."""
    return [summed_loss(model, batch) for batch in loader(packing=False, batch_size=1)]


def test_packed_loss_equals_the_token_weighted_mean_of_documents_alone(tiny_llama, loader):
    singles = alone(tiny_llama, loader)
    (packed,) = list(loader(packing=True, batch_size=8))
    assert packed["input_ids"].shape[0] < len(ROWS)  # documents really share rows
    assert packed["document_ids"].max(dim=1).values.gt(1).any()
    loss, tokens = summed_loss(tiny_llama, packed)
    assert tokens == sum(count for _, count in singles)
    expected = sum(loss_sum for loss_sum, _ in singles) / tokens
    assert abs(loss.item() / tokens - expected.item()) <= TOLERANCE


def test_padding_gives_each_sample_its_loss_alone(tiny_llama, loader):
    singles = alone(tiny_llama, loader)
    (padded,) = list(loader(packing=False, batch_size=len(ROWS)))
    assert padded["input_ids"].eq(0).any(dim=1).sum() == len(ROWS) - 1  # all but the longest are padded (pad id 0)
    with torch.no_grad():
        logits = tiny_llama(padded["input_ids"])
    for index, (loss_sum, count) in enumerate(singles):
        row = F.cross_entropy(logits[index], padded["labels"][index], ignore_index=IGNORE_INDEX, reduction="sum")
        assert abs(row.item() / count - loss_sum.item() / count) <= TOLERANCE


# --- every family's packed rows, forward and gradients (the per-document attention path) -----------

def _family_models():
    """name -> a builder of the native model: GQA Llama, Qwen with biased q/k/v and with sliding
    windows, Gemma 2 (soft-capped attention, a window of 8 that binds inside long documents), Gemma 3."""
    import gemma_tiny
    import posttune_llama
    import qwen_tiny
    from posttune.testing.tiny import native_from_hf, tiny_hf_model, tiny_llama_config

    llama = {c.family: c for c in posttune_llama.CONVERTERS}["llama"]
    return {
        "llama_gqa": lambda: native_from_hf(tiny_hf_model(tiny_llama_config()), posttune_llama.LLAMA, llama),
        "qwen2_bias": lambda: qwen_tiny.native_from_hf(tiny_hf_model(qwen_tiny.CONFIGS["qwen2_gqa"]())),
        "qwen3_attention_bias": lambda: qwen_tiny.native_from_hf(
            tiny_hf_model(qwen_tiny.CONFIGS["qwen3_attention_bias"]())),
        "qwen2_sliding_window": lambda: qwen_tiny.native_from_hf(
            tiny_hf_model(qwen_tiny.CONFIGS["qwen2_sliding_window"]())),
        "gemma2_softcap_window": lambda: gemma_tiny.native_from_hf(
            tiny_hf_model(gemma_tiny.CONFIGS["gemma2_softcap_window"]())),
        "gemma3_local_global": lambda: gemma_tiny.native_from_hf(
            tiny_hf_model(gemma_tiny.CONFIGS["gemma3_local_global_rope"]())),
    }


FAMILY_LENGTHS = ((5, 12, 7), (20, 4))  # rows of 24; the 12- and 20-token documents outrun an 8-token window


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "qwen3_attention_bias", "qwen2_sliding_window",
                                  "gemma2_softcap_window", "gemma3_local_global"])
def test_every_family_trains_packed_rows_as_its_documents_alone(name):
    model = _family_models()[name]().train()
    ids = torch.randint(1, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in FAMILY_LENGTHS])
    packed = model(ids, document_ids=documents)
    packed.logsumexp(-1).sum().backward()
    packed_grads = {key: p.grad.clone() for key, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.cat([torch.cat([model(doc[None]) for doc in row.split(lengths)], dim=1)
                       for row, lengths in zip(ids, FAMILY_LENGTHS)])
    alone.logsumexp(-1).sum().backward()
    torch.testing.assert_close(packed, alone, rtol=0, atol=TOLERANCE)
    for key, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[key], p.grad, rtol=0, atol=TOLERANCE, msg=key)
