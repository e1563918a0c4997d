"""`data.pad_to_multiple_of` and `data.group_by_length` reach the SFT, DPO and KD loaders, and the extra
padding changes no loss: padded positions carry no target and right padding is never attended to."""

from __future__ import annotations

import posttune_generate

import posttune_lora
import pytest
import torch
from run_support import compose_run, dpo_config, kd_config, save_hf_teacher, sft_config


def first_batch_loss(config: dict) -> tuple[torch.Tensor, tuple[int, ...]]:
    session = compose_run(config)
    batch = next(iter(session.train_data))
    with torch.no_grad():
        out = session.plan.method.descriptor.loss(session, batch)
    return out.loss_sum / out.normaliser, tuple(batch["input_ids"].shape)


@pytest.mark.parametrize("make_config, method", [(sft_config, {"padding_free": False}), (sft_config, {}),
                                                 (dpo_config, {"padding_free": False}), (dpo_config, {})],
                         ids=["sft", "sft_padding_free", "dpo", "dpo_padding_free"])
def test_padding_to_a_multiple_of_64_leaves_the_loss_unchanged(llama_dpo, tmp_path, make_config, method):
    plain, plain_shape = first_batch_loss(make_config(tmp_path / "plain", rows=8, method=method))
    rounded, rounded_shape = first_batch_loss(make_config(tmp_path / "rounded", rows=8, method=method,
                                                          data={"pad_to_multiple_of": 64}))
    assert plain_shape[1] % 64 and rounded_shape == (plain_shape[0], -(-plain_shape[1] // 64) * 64)
    torch.testing.assert_close(rounded, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("make_config", [sft_config, dpo_config], ids=["sft", "dpo"])
def test_group_by_length_reaches_the_train_loader(llama_dpo, tmp_path, make_config):
    session = compose_run(make_config(tmp_path, rows=40, data={"group_by_length": True}))
    loader = session.train_data
    assert loader.grouped and loader.lengths is not None and len(loader.lengths) == 40
    rows = sorted(int(row) for batch in loader for row in batch.get("rows", []))
    assert make_config is sft_config or rows == list(range(40))  # pairs carry their dataset rows


def test_distillation_batches_pad_to_a_multiple_too_and_keep_their_loss(register_plugin, tmp_path):
    import posttune_kd
    import posttune_llama

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_kd, distribution="posttune-kd", version="0.1.0")
    teacher = save_hf_teacher(tmp_path / "teacher")
    plain, plain_shape = first_batch_loss(kd_config(tmp_path / "plain", teacher, rows=8))
    rounded, rounded_shape = first_batch_loss(kd_config(tmp_path / "rounded", teacher, rows=8,
                                                        data={"pad_to_multiple_of": 64}))
    assert plain_shape[1] < 64 and rounded_shape == (plain_shape[0], 64)
    torch.testing.assert_close(rounded, plain, atol=1e-6, rtol=0)
