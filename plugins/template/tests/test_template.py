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
    assert "toy_lm  posttune-template 0.1.0" in posttune_cli("ls", "methods").stdout
    assert "template-bigram" in posttune_cli("ls", "configs").stdout


def test_bundled_config_validates_and_plans(register_plugin, posttune_cli):
    register_plugin(posttune_template, distribution="posttune-template", version="0.1.0")
    result = posttune_cli("validate", "template-bigram")
    assert result.exit_code == 0, result.stderr
    plan = posttune_cli("plan", "template-bigram").stdout
    assert "model family 'bigram'" in plan and "method 'toy_lm'" in plan


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
    assert int(out.num_tokens) == 4
    torch.testing.assert_close(out.loss_sum, expected)
