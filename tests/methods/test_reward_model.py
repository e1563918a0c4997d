"""posttune-rm: the Bradley-Terry loss equals TRL's, and a reward model round-trips with transformers.

- The loss (with margin and reward centring) is TRL's ``RewardTrainer.compute_loss`` on the same
  rewards (1e-6), driven through its own code on a stand-in model that returns the rewards.
- A reward model trained here from a causal checkpoint saves as ``LlamaForSequenceClassification``
  and transformers scores padded rows exactly as posttune does (1e-5); a sequence classifier
  written by transformers (Qwen2: biases, another family) loads here with equal scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
import yaml
from run_support import dpo_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_qwen
import posttune_rm
from posttune.testing.tiny import TINY, save_tiny_hf_checkpoint, tiny_llama_config

TOL = 1e-6


@pytest.fixture
def llama_rm(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    register_plugin(posttune_rm, distribution="posttune-rm", version="0.1.0")


def rm_config(tmp_path: Path, **sections) -> dict:
    config = dpo_config(tmp_path, **sections)
    config["method"] = {"name": "reward_model", **sections.get("method", {})}
    return config


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("margin, center", [(0.0, None), (0.5, 0.01), ((0.0, 0.5, 2.0, 0.25, 1.0, 3.0), None)])
def test_bradley_terry_equals_trl_reward_trainer(margin, center):
    trl = pytest.importorskip("trl")
    from posttune_rm.losses import bradley_terry

    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(6, generator=generator), torch.randn(6, generator=generator)
    logits = torch.cat([chosen, rejected]).unsqueeze(-1)  # TRL: chosen rows, then rejected, one score each
    accelerator = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=accelerator, _tp_size=1,
                              args=SimpleNamespace(center_rewards_coefficient=center),
                              _metrics={"eval": __import__("collections").defaultdict(list)}, _total_train_tokens=0)
    inputs = {"input_ids": torch.zeros(12, 3, dtype=torch.long), "attention_mask": torch.ones(12, 3)}
    if isinstance(margin, tuple):  # each pair its own (TRL's `margin` column; posttune's method.margin_column)
        margin = torch.tensor(margin)
    if isinstance(margin, torch.Tensor) or margin:
        inputs["margin"] = margin if isinstance(margin, torch.Tensor) else torch.full((6,), margin)
    expected = trl.RewardTrainer.compute_loss(trainer, lambda **_: SimpleNamespace(logits=logits), inputs)
    ours = bradley_terry(chosen, rejected, margin=margin, center_coefficient=center).mean()
    assert abs(float(ours) - float(expected)) <= TOL
    assert trainer._metrics["eval"]["accuracy"] == [pytest.approx(float((chosen > rejected).float().mean()))]


def margin_rows(count: int) -> list[dict]:
    """Preference rows, each with its own margin (0, 0.5, ..., 2.5, repeating): the row's index tells its margin."""
    from run_support import preference_rows

    return [{**row, "margin": (index % 6) * 0.5} for index, row in enumerate(preference_rows(count))]


@pytest.mark.parametrize("padding_free", [True, False])
def test_each_pairs_margin_reaches_its_loss(llama_rm, tmp_path, padding_free):
    """``margin_column``: every micro-batch's ``margins`` are its pairs' own, in the batch's order (its ``rows``),
    and the loss is the Bradley-Terry formula with them on the batch's rewards."""
    import torch.nn.functional as F

    from posttune.config import load_config, validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training.compose import compose
    from posttune_rm.method import loss, rewards

    rows = margin_rows(12)
    config = rm_config(tmp_path, method={"margin_column": "margin", "padding_free": padding_free})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    session = compose(resolve_plan(validate(load_config(write(tmp_path, config), [])), get_registry()))
    seen = []
    for batch in session.train_data:
        expected = torch.tensor([rows[int(r)]["margin"] for r in batch["rows"]])
        torch.testing.assert_close(batch["margins"], expected, atol=0, rtol=0)
        with torch.no_grad():
            chosen, rejected = rewards(session, batch).chunk(2)
            out = loss(session, batch)
        torch.testing.assert_close(out.loss_sum, -F.logsigmoid(chosen - rejected - expected).sum(), atol=1e-6, rtol=0)
        seen += batch["rows"].tolist()
    assert sorted(seen) == list(range(12))  # every pair once, with margins 0 to 2.5 among them


def test_an_empty_share_trains_nothing(llama_rm, tmp_path):
    """A rank with no pair this step (fewer pairs than ranks) runs a placeholder pair: no loss, no pair counted, no
    gradient, also with the centring term (which a padding row would otherwise train)."""
    from run_support import compose_run

    from posttune.data.collate import pair_batch
    from posttune.plugin import pad_id
    from posttune_rm.method import loss

    session = compose_run(rm_config(tmp_path, method={"center_rewards_coefficient": 0.01}))
    batch = pair_batch([], pad_id=pad_id(session.tokenizer))
    assert batch["rows"].tolist() == [-1]
    out = loss(session, batch)
    assert float(out.loss_sum) == 0.0 and float(out.normaliser) == 0.0
    out.loss_sum.backward()
    assert all(p.grad is None or not p.grad.any() for p in session.model.parameters())


@pytest.mark.parametrize("margin, problem", [
    ("wide", "field 'margin' must be a number >= 0 (the pair's margin), got 'wide'"),
    (-1.5, "field 'margin' must be a number >= 0 (the pair's margin), got -1.5"),
    (None, "field 'margin' must be a number >= 0 (the pair's margin), got None"),  # a row without it: null
    ("no column", "missing field 'margin'"),
])
def test_a_bad_margin_is_refused_naming_its_row(llama_rm, posttune_cli, tmp_path, margin, problem):
    rows = margin_rows(8)
    if margin == "no column":
        rows = [{key: value for key, value in row.items() if key != "margin"} for row in rows]
    elif margin is None:
        del rows[5]["margin"]
    else:
        rows[5]["margin"] = margin
    config = rm_config(tmp_path, method={"margin_column": "margin"}, train={"max_steps": 1})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 2
    row = 0 if margin == "no column" else 5
    assert result.stderr == (f"posttune: error: data.train: row {row}: {problem} (set data.skip_bad_rows: true to skip "
                             "such rows)\n")


def hf_scores(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.pad_token_id is not None
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != model.config.pad_token_id).long()).logits


def our_scores(model_dir: Path, ids: torch.Tensor, pad: int) -> torch.Tensor:
    from posttune.plugin import load_model, sequence_scores

    model = load_model(model_dir, dtype="fp32")
    with torch.no_grad():
        return sequence_scores(model(ids), ids, pad)


def padded_ids(pad: int, vocab: int = 300) -> torch.Tensor:
    ids = torch.randint(5, vocab, (4, 11), generator=torch.Generator().manual_seed(1))
    ids[ids == pad] = pad + 1
    ids[1, 7:] = pad
    ids[3, 4:] = pad
    return ids


def test_a_reward_model_trained_from_a_causal_checkpoint_scores_the_same_in_transformers(llama_rm, posttune_cli,
                                                                                         tmp_path):
    source = tmp_path / "causal"
    save_tiny_hf_checkpoint(source, tiny_llama_config(vocab_size=384, tie_word_embeddings=True))
    config = rm_config(tmp_path, rows=12, method={"center_rewards_coefficient": 0.01},
                       train={"epochs": 2, "eval_every": 3})
    config["model"] = {"path": str(source), "family": "llama"}
    config["data"]["validation"] = dict(config["data"]["train"])
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    out = Path(config["checkpoint"]["output_dir"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["pairs"] == 4 for r in records)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "rewards/mean",
                "rewards/std"):
        assert key in records[-1] and f"val_{key}" in records[2]
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"] and saved["num_labels"] == 1
    assert not saved["tie_word_embeddings"]  # the embedding stays; the LM head it was tied to is gone
    ids = padded_ids(saved["pad_token_id"])
    ours, theirs = our_scores(out / "model", ids, saved["pad_token_id"]), hf_scores(out / "model", ids)
    assert ours.shape == theirs.shape == (4, 1)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours, theirs)
    assert theirs.std() > 0  # the rows are told apart: a constant score would pass trivially


def test_a_transformers_sequence_classifier_loads_with_equal_scores(llama_rm, tmp_path):
    config = transformers.Qwen2Config(**{**TINY, "num_labels": 1, "pad_token_id": 3})
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path / "rm")
    ids = padded_ids(3)
    assert torch.allclose(our_scores(tmp_path / "rm", ids, 3), hf_scores(tmp_path / "rm", ids), atol=1e-5, rtol=0)


def test_the_saved_reward_model_resaves_and_reloads_unchanged(llama_rm, tmp_path):
    from posttune.plugin import load_model, save_model

    config = transformers.LlamaConfig(**{**TINY, "num_labels": 1})
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path / "a")
    save_model(load_model(tmp_path / "a", dtype="fp32"), tmp_path / "b")
    ids = padded_ids(0)
    assert torch.equal(hf_scores(tmp_path / "a", ids), hf_scores(tmp_path / "b", ids))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_lora_reward_model_loads_in_peft_with_its_score_head_and_resumes(llama_rm, posttune_cli, tmp_path, kind):
    peft = pytest.importorskip("peft")
    source = tmp_path / "causal"
    save_tiny_hf_checkpoint(source, tiny_llama_config(vocab_size=384))
    config = rm_config(tmp_path, rows=12, train={"epochs": 2},
                       checkpoint={"save_every": 3, "keep_last": 3, "save_merged": True},
                       adapter={"rank": 4, "alpha": 8, "kind": kind})
    config["model"] = {"path": str(source), "family": "llama"}
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    out = Path(config["checkpoint"]["output_dir"])
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["score"]

    base = transformers.AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = 4  # the demo tokenizer's pad id, which training pooled by
    model = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = padded_ids(4)
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=(ids != 4).long()).logits

    from posttune.plugin import load_adapter, load_model, sequence_scores
    from posttune.checkpoint.score_head import add_score_head

    ours_model = add_score_head(load_model(source, dtype="fp32"))
    load_adapter(ours_model, out / "adapter")
    with torch.no_grad():
        ours = sequence_scores(ours_model.eval()(ids), ids, 4)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours, theirs)
    merged = hf_scores(out / "model", ids)  # save_merged: the sequence classifier with the adapters folded in
    assert torch.allclose(merged, theirs, atol=1e-5, rtol=0), (merged, theirs)
    drawn = torch.randn(1, TINY["hidden_size"], generator=torch.Generator().manual_seed(0)) * 0.02  # train.seed 0
    assert (ours_model.output.weight - drawn).abs().max() > 1e-4  # the head trained beside the adapters

    # resume from step 3 of 6: the adapter and the head come back, the rest of the run is the same
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = {**config, "checkpoint": {**config["checkpoint"], "output_dir": str(tmp_path / "again"),
                                        "resume": str(out / "checkpoints" / "step-00000003")}}
    result = posttune_cli("train", str(write(tmp_path, resumed)))
    assert result.exit_code == 0, result.stderr
    again = [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again if r["step"] > 3] == [r["loss"] for r in records if r["step"] > 3]


@pytest.mark.parametrize("section, value, field", [
    ("method", {"margin": -1.0}, "method.margin"),
    ("method", {"center_rewards_coefficient": -0.1}, "method.center_rewards_coefficient"),
    ("method", {"margin_column": "margin", "margin": 0.5}, "method.margin"),
    ("method", {"margin_column": " "}, "method.margin_column"),
    ("parallel", {"plans": ["tp"]}, "parallel.plans"),
])
def test_bad_settings_are_refused_in_one_line(llama_rm, posttune_cli, tmp_path, section, value, field):
    config = rm_config(tmp_path, **{section: value})
    if section == "method":
        config["method"].update(value)
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert field in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
