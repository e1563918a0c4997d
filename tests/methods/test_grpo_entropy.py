"""GRPO's ``top_entropy_quantile`` (Wang et al. 2025, "Beyond the 80/20 Rule"): only the completion tokens where
the policy's distribution has the highest entropy take the policy term.

- The token selection against TRL's own ``GRPOTrainer.get_high_entropy_mask`` (one process), at the ends
  (0, 1), between them and with ties; tokens outside the considered mask are never chosen.
- The loss and its gradient against TRL's ``_compute_loss`` with ``top_entropy_quantile`` set, for each
  aggregation, with the KL term (which the selection leaves alone) and without; the option acts on the case.
- A run: 1 trains exactly as the default; 0.2 logs the trained tokens' entropy and the share selected, and
  trains; values outside [0, 1] are refused. (The entropies themselves are pinned against torch.distributions
  in tests/core/test_labelled_logits.py; the padded and padding-free layouts agree in
  test_grpo_padding_free.py; two ranks select over both ranks' tokens in tests/distributed/test_grpo_parity.py.)
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from test_grpo_gspo_truncation import EPSILONS, MAX_NEW_TOKENS, TOL, TRL_LOSS_TYPE, OneProcess, case_tensors, trl_loss
from test_grpo_loss import LENGTHS
from test_grpo_training import llama_grpo, records, vowel_config, write  # noqa: F401  (a fixture and helpers)

from posttune_grpo.loss import aggregate, high_entropy_mask, policy_loss


def entropies_of(mask: torch.Tensor, seed: int = 7, ties: bool = False) -> torch.Tensor:
    values = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * 4
    if ties:  # a few distinct values, many tokens sharing each
        values = values.round()
    return values * mask


def trl_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="the reference is TRL's GRPO trainer")
    trainer = types.SimpleNamespace(accelerator=OneProcess())
    return grpo_trainer.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 1 - quantile)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_the_selected_tokens_are_trls(quantile, ties):
    mask = case_tensors("first_pass")[0]["mask"]
    considered = mask.clone()
    considered[1] = 0  # a completion left out (truncated and masked, or a placeholder): none of its tokens count
    entropies = entropies_of(mask, ties=ties)
    ours = high_entropy_mask(entropies, considered, quantile)
    theirs = trl_mask(entropies, considered, quantile)
    assert torch.equal(ours.bool(), theirs)
    assert not ours[considered == 0].any()
    count = int(considered.sum())
    if quantile == 1.0:
        assert int(ours.sum()) == count
    elif quantile == 0.0:
        assert bool((entropies[ours.bool()] == entropies[considered.bool()].max()).all())
    elif not ties:  # linear interpolation between neighbours: the share chosen is the quantile, to a token
        assert abs(int(ours.sum()) - quantile * count) <= 1


def test_nothing_considered_selects_nothing():
    mask = case_tensors("first_pass")[0]["mask"]
    assert high_entropy_mask(entropies_of(mask), torch.zeros_like(mask), 0.2).sum() == 0


@pytest.mark.parametrize("case", ["clipped", "clipped_kl"])
@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
def test_loss_and_gradient_with_high_entropy_tokens_equal_trls(how, case):
    inputs, old, beta, _ = case_tensors(case)
    mask, (epsilon, epsilon_high) = inputs["mask"], EPSILONS["token"]
    entropies = entropies_of(mask)
    results = []
    for quantile in (1.0, 0.3):
        logps = inputs["logps"].clone().requires_grad_()
        token_mask = high_entropy_mask(entropies, mask, quantile) if quantile < 1 else None
        result = policy_loss(logps, old, inputs["advantages"], mask, epsilon=epsilon, epsilon_high=epsilon_high,
                             ref_logps=inputs["ref"] if beta else None, beta=beta, token_mask=token_mask)
        loss_sum, normaliser = aggregate(result.per_token, mask, how, MAX_NEW_TOKENS, torch.ones(len(LENGTHS)))
        (loss_sum / normaliser).backward()
        results.append((loss_sum / normaliser, logps.grad))
    (everything, _), (ours, ours_grad) = results
    assert abs(float(ours.detach()) - float(everything.detach())) > 1e-4  # the selection acts on this case

    theirs_logps = inputs["logps"].clone().requires_grad_()
    theirs = trl_loss(theirs_logps, inputs, loss_type=TRL_LOSS_TYPE[how], level="token", epsilon=epsilon,
                      epsilon_high=epsilon_high, beta=beta, old=old, is_weights=None, mask=mask, entropies=entropies,
                      top_entropy_quantile=0.3)
    theirs.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours_grad, theirs_logps.grad, atol=TOL, rtol=0)
    if beta:  # the KL term still reaches every token: unselected tokens keep a gradient
        unselected = (mask > 0) & ~high_entropy_mask(entropies, mask, 0.3).bool()
        assert bool((ours_grad[unselected] != 0).all())


def test_a_run_selects_high_entropy_tokens_and_one_is_the_default_run(llama_grpo, posttune_cli, tmp_path):  # noqa: F811
    runs = {}
    for name, method in {"default": {}, "all": {"top_entropy_quantile": 1.0},
                         "fifth": {"top_entropy_quantile": 0.2}}.items():
        config = vowel_config(tmp_path / name, method=method, train={"max_steps": 2})
        result = posttune_cli("train", str(write(tmp_path / name, config)))
        assert result.exit_code == 0, result.stderr
        runs[name] = records(config)
    keys = ("loss", "grad_norm", "reward")
    assert [[r[k] for k in keys] for r in runs["all"]] == [[r[k] for k in keys] for r in runs["default"]]
    assert "entropy" not in runs["default"][0]
    for record in runs["fifth"]:
        assert 0 < record["entropy"] <= math.log(384)  # nats, at most the uniform distribution's over the vocabulary
        assert 0.1 < record["entropy_selected"] < 0.35
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    assert runs["fifth"][0]["grad_norm"] != runs["default"][0]["grad_norm"]


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_a_share_outside_zero_to_one_is_refused(llama_grpo, posttune_cli, tmp_path, value):  # noqa: F811
    config = vowel_config(tmp_path, method={"top_entropy_quantile": value})
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr.strip() == ("posttune: error: config: method.top_entropy_quantile: expected a share in "
                                     f"[0, 1], got {value}")


def test_max_new_tokens_past_the_context_is_refused_and_a_long_prompt_warned(llama_grpo, posttune_cli,  # noqa: F811
                                                                             tmp_path):
    """Generation stops at max_position_embeddings: completions past it were cut and counted as truncated, silently."""
    model = {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384, "max_position_embeddings": 64}}
    config = vowel_config(tmp_path / "a", model=model, method={"max_new_tokens": 64}, train={"max_steps": 1})
    result = posttune_cli("train", str(write(tmp_path / "a", config)))
    assert (result.exit_code, result.stderr.splitlines()[-1]) == (2, (
        "posttune: error: config: method.max_new_tokens: 64 leaves no room for a prompt in the model's context of 64 "
        "tokens (max_position_embeddings)"))
    config = vowel_config(tmp_path / "b", model=model, method={"max_new_tokens": 40}, train={"max_steps": 1},
                          data={"max_prompt_len": 32})
    result = posttune_cli("train", str(write(tmp_path / "b", config)))
    assert result.exit_code == 0, result.stderr
    assert ("posttune: warning: method.max_new_tokens: a prompt of 32 tokens (data.max_prompt_len) leaves 32 of the "
            "40 new tokens in the model's context of 64: longer completions are cut there") in result.stderr
