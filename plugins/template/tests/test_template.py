"""The example plugin's own tests, written with posttune's pytest fixtures as any plugin's would be."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

import posttune_template
from posttune_template.method import ToyLMConfig, loss
from posttune_template.model import build


def test_registers_family_method_and_config(register_plugin, posttune_cli):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    assert "bigram  posttune-template 0.1.0" in posttune_cli("ls", "families").stdout
    methods = posttune_cli("ls", "methods").stdout
    assert "toy_lm    posttune-template 0.1.0" in methods and "toy_rank  posttune-template 0.1.0" in methods
    assert "template-bigram" in posttune_cli("ls", "configs").stdout


def test_bundled_config_validates_and_plans(register_plugin, posttune_cli):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    result = posttune_cli("validate", "template-bigram")
    assert result.exit_code == 0, result.stderr
    plan = posttune_cli("plan", "template-bigram").stdout
    assert "model family 'bigram'" in plan and "method 'toy_lm'" in plan


def test_bundled_config_trains_as_shipped(register_plugin, posttune_cli, tmp_path):
    """``posttune train template-bigram``: the shipped tokenizer and chats, one epoch, a saved model."""
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    result = posttune_cli("train", "template-bigram", f"checkpoint.output_dir={tmp_path / 'out'}")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "model").is_dir() and (tmp_path / "out" / "metrics.jsonl").read_text().strip()


def test_an_override_the_builder_does_not_take_is_refused_by_validate(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    result = posttune_cli("validate", "template-bigram", "model.build_overrides.hiden_size=8")
    assert result.exit_code == 2
    assert result.stderr == ("posttune: error: config: model.build_overrides.hiden_size: family 'bigram' "
                             "(posttune-template 0.1.0) builds with no argument 'hiden_size' (did you mean "
                             "'hidden_size'?) (arguments: vocab_size, hidden_size)\n")


def test_model_predicts_logits_over_the_vocabulary():
    model = build(vocab_size=11, hidden_size=4)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 11)


def test_loss_is_the_summed_next_token_cross_entropy_over_labelled_tokens():
    torch.manual_seed(0)
    model = build(vocab_size=7, hidden_size=5)
    input_ids = torch.tensor([[1, 2, 3, 4], [5, 6, 1, 0]])
    labels = torch.tensor([[2, 3, 4, -100], [-100, 1, -100, -100]])  # pre-shifted: the target of each position
    session = SimpleNamespace(model=model, method_config=ToyLMConfig())
    out = loss(session, {"input_ids": input_ids, "labels": labels})
    logits = model(input_ids)
    expected = sum(F.cross_entropy(logits[b, t], labels[b, t], reduction="sum")
                   for b in range(2) for t in range(4) if labels[b, t] != -100)
    assert int(out.normaliser) == 4
    torch.testing.assert_close(out.loss_sum, expected)


# -- toy_rank: a preference method written against the public surface only -------------------

def preference_run(tmp_path, **train):
    """A toy_rank config over pairs that prefer agreeing answers to refusals (a bigram can learn that)."""
    import json

    import yaml

    from posttune.plugin import save_tiny_tokenizer

    tokenizer = save_tiny_tokenizer(tmp_path / "tok", template="chatml")
    rows = [{"prompt": f"Question {i}?", "chosen": ("yes", "sure", "ok")[i % 3], "rejected": ("no", "never")[i % 2]}
            for i in range(16)]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "model": {"family": "bigram", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": str(tokenizer)},
        "method": {"name": "toy_rank", "scale": 2.0},
        "data": {"train": {"path": str(data), "format": "preference"}, "max_seq_len": 96},
        "train": {"epochs": 3, "batch_size": 4, "lr": 0.05, "seed": 0, "device": "cpu", **train},
        "checkpoint": {"output_dir": str(tmp_path / "out"), "save_every": 4},
    }
    path = tmp_path / "rank.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / "out"


def records(out):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_toy_rank_trains_on_preference_pairs_and_counts_pairs(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    path, out = preference_run(tmp_path)
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    steps = records(out)
    assert [r["pairs"] for r in steps] == [4] * 12  # the normaliser counts pairs
    assert [r["pairs_seen"] for r in steps] == [4 * (i + 1) for i in range(12)]  # state kept by on_step_end
    assert steps[-1]["accuracy"] == 1.0 and steps[-1]["margin"] > steps[0]["margin"] + 1.0
    assert steps[-1]["loss"] < steps[0]["loss"] / 2


def test_toy_rank_state_survives_a_resume(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    path, out = preference_run(tmp_path, max_steps=8)
    assert posttune_cli("train", str(path)).exit_code == 0
    resumed = posttune_cli("train", str(path), "train.max_steps=12", "checkpoint.resume=latest")
    assert resumed.exit_code == 0, resumed.stderr
    assert [r["pairs_seen"] for r in records(out)] == [4 * (i + 1) for i in range(12)]  # counted on from step 8


def test_toy_rank_refuses_a_bad_scale_before_launch(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    path, _ = preference_run(tmp_path)
    result = posttune_cli("validate", str(path), "method.scale=-1")
    assert result.exit_code == 2
    assert result.stderr == "posttune: error: config: method.scale: expected a positive number, got -1.0\n"
