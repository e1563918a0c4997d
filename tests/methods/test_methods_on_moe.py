"""Every method runs unchanged on a mixture-of-experts family (tiny qwen3_moe): the trainer adds the
model's load-balancing loss to the method's with its coefficient and logs it apart (docs/moe.md).

SFT's first loss is pinned to transformers' own (``output_router_logits=True`` adds
``router_aux_loss_coef * aux_loss`` to the mean cross-entropy); DPO, GRPO and on-policy-free KD
train a few steps and log the routing metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from run_support import compose_run, dpo_config, grpo_config, kd_config, save_hf_teacher, sft_config

import posttune_dpo
import posttune_generate
import posttune_grpo
import posttune_kd
import posttune_llama
import posttune_qwen
import posttune_sft
from posttune.testing.tiny import TINY, tiny_hf_model
from posttune.training.distributed import padded_sequence
from posttune.training.trainer import counting_real_tokens, with_aux_loss

MOE_MODEL = {"family": "qwen3_moe", "size": "tiny", "build_overrides": {"vocab_size": 384}}
ROUTING = ("aux_loss", "expert_tokens_min", "expert_tokens_mean", "expert_tokens_max")


@pytest.fixture
def plugins(register_plugin):
    for module, name in [(posttune_qwen, "qwen"), (posttune_llama, "llama"), (posttune_sft, "sft"),
                         (posttune_dpo, "dpo"), (posttune_grpo, "grpo"), (posttune_kd, "kd"),
                         (posttune_generate, "generate")]:
        register_plugin(module, distribution=f"posttune-{name}", version="0.1.0")


def _records(config: dict) -> list[dict]:
    path = Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _hf_moe_session(tmp_path: Path, batch_size: int, **method) -> tuple[transformers.PreTrainedModel, object]:
    hf_model = tiny_hf_model(transformers.Qwen3MoeConfig(**{
        **TINY, "vocab_size": 384, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "router_aux_loss_coef": 0.02}))
    hf_model.save_pretrained(tmp_path / "moe")
    config = sft_config(tmp_path, model={"path": str(tmp_path / "moe")}, train={"batch_size": batch_size})
    config["model"].pop("family"), config["model"].pop("size"), config["model"].pop("build_overrides")
    config["method"].update(method)
    return hf_model, compose_run(config)


def test_sft_loss_is_transformers_loss_with_its_aux_term(plugins, tmp_path):
    hf_model, session = _hf_moe_session(tmp_path, 1)
    session.model.train()
    batch = next(iter(session.train_data))
    out = with_aux_loss(session, posttune_sft.loss(session, batch))
    ids = batch["input_ids"]
    labels = torch.cat([torch.full_like(ids[:, :1], -100), batch["labels"][:, :-1]], dim=1)  # unshift
    expected = hf_model(ids, labels=labels, output_router_logits=True)
    torch.testing.assert_close(out.loss_sum / out.normaliser, expected.loss, atol=1e-5, rtol=1e-5)
    assert abs(out.metrics["aux_loss"].item() - expected.aux_loss.item()) <= 1e-6


def _aux_loss(session, batch: dict, pad_to: int = 1) -> float:
    """The micro-batch's load-balancing loss as the trainer computes it (after the plans' padding)."""
    pop = session.model.aux_loss
    with padded_sequence(batch, pad_to), counting_real_tokens(session, batch):
        pop()
        out = with_aux_loss(session, posttune_sft.loss(session, batch))
    return out.metrics["aux_loss"].item()


def test_padding_stays_out_of_the_aux_loss_as_transformers_attention_mask(plugins, tmp_path):
    """A padded batch's aux loss is transformers' with its attention mask, the padding-free batch's, and
    unchanged by the extra padding sequence parallelism adds; counting every token would change it."""
    hf_model, session = _hf_moe_session(tmp_path / "padded", 4, padding_free=False)
    session.model.train()
    batch = next(iter(session.train_data))
    real = batch["real_tokens"]
    assert not real.all() and real.any(dim=1).all()  # rows of different lengths: padding to leave out
    labels = torch.cat([torch.full_like(batch["input_ids"][:, :1], -100), batch["labels"][:, :-1]], dim=1)
    expected = hf_model(batch["input_ids"], attention_mask=real.long(), labels=labels,
                        output_router_logits=True).aux_loss.item()
    padded = _aux_loss(session, dict(batch))
    assert abs(padded - expected) <= 1e-6
    assert abs(_aux_loss(session, dict(batch), pad_to=batch["input_ids"].shape[1] + 5) - expected) <= 1e-6
    counted_all = _aux_loss(session, {key: value for key, value in batch.items() if key != "real_tokens"})
    assert abs(counted_all - expected) > 1e-4  # the check can fail: padding counted moves it

    _, flat_session = _hf_moe_session(tmp_path / "flat", 4, padding_free=True)
    flat_session.model.train()
    flat = next(iter(flat_session.train_data))
    assert flat["real_tokens"].sum() == real.sum()
    assert abs(_aux_loss(flat_session, dict(flat), pad_to=7) - expected) <= 1e-6


@pytest.mark.parametrize("method", ["sft", "dpo", "grpo", "kd"])
def test_each_method_trains_on_moe_and_logs_routing(plugins, posttune_cli, tmp_path, method):
    if method == "kd":
        config = kd_config(tmp_path, save_hf_teacher(tmp_path / "teacher"), rows=8)
    else:
        config = {"sft": sft_config, "dpo": dpo_config, "grpo": grpo_config}[method](tmp_path, rows=8)
    config["model"] = dict(MOE_MODEL)
    config["train"]["max_steps"] = 2
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(tmp_path / "run.yaml"))
    assert result.exit_code == 0, result.stderr
    steps = [r for r in _records(config) if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert all(key in record for key in ROUTING), sorted(record)
        assert 0 < record["aux_loss"] < 8  # top_k (2) when the load is uniform, experts (8) at most
        assert torch.isfinite(torch.tensor(record["loss"]))


@pytest.mark.parametrize(("override", "message"), [
    ({"top_k": 9}, "top_k must be between 1 and the 8 experts, got 9"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef and z_loss_coef must be >= 0, got -1.0 and 0.0"),
])
def test_bad_moe_build_override_is_one_line(plugins, posttune_cli, tmp_path, override, message):
    config = sft_config(tmp_path, rows=8)
    config["model"] = {**MOE_MODEL, "build_overrides": {**MOE_MODEL["build_overrides"], **override}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(tmp_path / "run.yaml"))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"posttune: error: config: model.build_overrides: family 'qwen3_moe': {message}")
