"""SFT's `method.padding_free` (its default): a batch's samples end to end in one row give the padded
batch's losses and gradients, step after step, without computing any padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_support import compose_run, dpo_config, sft_config

from posttune.data import IGNORE_INDEX
from posttune.data.collate import flat_batch, padded_batch
from posttune.data.samples import Sample
from posttune.errors import ConfigError
from posttune.training.metrics import read_metrics
from posttune.training.trainer import train


def sample(ids: list[int], labels: list[int], row: int) -> Sample:
    return Sample(ids=torch.tensor(ids), labels=torch.tensor(labels), row=row)


def test_flat_batch_puts_the_samples_end_to_end_as_documents():
    samples = [[sample([5, 6, 7], [IGNORE_INDEX, 7, 2], 0)], [sample([8, 9], [9, 2], 1)]]
    flat = flat_batch(samples, pad_id=0)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert flat["labels"].tolist() == [[IGNORE_INDEX, 7, 2, 9, 2]]
    assert flat["document_ids"].tolist() == [[0, 0, 0, 1, 1]] and int(flat["num_tokens"]) == 5
    rounded = flat_batch(samples, pad_id=0, pad_to_multiple_of=4)
    assert rounded["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert rounded["labels"][0, 5:].eq(IGNORE_INDEX).all() and rounded["document_ids"].tolist()[0][5:] == [2, 2, 2]
    padded = padded_batch(samples, pad_id=0)
    assert int(padded["num_tokens"]) == 5 and padded["input_ids"].shape == (2, 3)


def losses(tmp_path: Path, **method) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    config = sft_config(tmp_path, rows=16, train={"max_steps": 4, "batch_size": 4, "lr": 3e-3}, method=method)
    session = compose_run(config)
    first = next(iter(session.train_data))
    train(session)
    records = read_metrics(Path(config["checkpoint"]["output_dir"]))
    weights = {name: p.detach().clone() for name, p in session.model.named_parameters()}
    return [r["loss"] for r in records], [r["tokens"] for r in records], {"batch": first, **weights}


def test_padding_free_training_equals_padded_training(llama_dpo, tmp_path):
    flat_losses, flat_tokens, flat = losses(tmp_path / "flat")
    padded_losses, padded_tokens, padded = losses(tmp_path / "padded", padding_free=False)
    assert flat["batch"]["input_ids"].shape[0] == 1 and padded["batch"]["input_ids"].shape[0] == 4
    assert flat["batch"]["input_ids"].numel() < padded["batch"]["input_ids"].numel()  # no padding computed
    assert flat_tokens == padded_tokens and len(flat_losses) == 4
    torch.testing.assert_close(flat_losses, padded_losses, rtol=0, atol=1e-5)
    for name, weight in padded.items():
        if name != "batch":
            torch.testing.assert_close(flat[name], weight, rtol=0, atol=1e-5, msg=name)


def test_the_old_data_keys_are_refused_naming_the_method_setting(llama_dpo, tmp_path):
    for key in ("padding_free", "packing"):
        with pytest.raises(ConfigError, match=rf"^config: data\.{key}: moved: set method\.{key}$"):
            compose_run(sft_config(tmp_path, data={key: False}))


def test_methods_that_keep_padded_rows_have_no_padding_free_setting(llama_dpo, tmp_path):
    with pytest.raises(ConfigError, match=r"^config: method\.padding_free: unknown key"):
        compose_run(dpo_config(tmp_path, method={"padding_free": True}))


def test_sft_refuses_to_group_packed_rows(llama_dpo, tmp_path):
    with pytest.raises(ConfigError, match=r"^config: data\.group_by_length: packed rows are already full and need no "
                                          r"grouping; set method\.packing or data\.group_by_length, not both$"):
        compose_run(sft_config(tmp_path, method={"packing": True}, data={"group_by_length": True}))
