"""GRPO's ``importance_sampling_level: sequence`` (GSPO), ``mask_truncated_completions`` (DAPO's overlong
filtering) and ``objective`` ``cispo`` (MiniMax-M1) and ``sapo`` (Qwen's SAPO).

- The loss and its gradient against TRL's own ``GRPOTrainer._compute_loss`` run on the same log-probs,
  advantages and masks (its forward replaced by the given log-probs), for both ratio levels and each
  aggregation (token = TRL's ``dapo``, sequence = ``grpo``, constant = ``dr_grpo``), first pass and clipped,
  with the KL term and with per-token truncated importance weights; and against GSPO's formula written
  out sequence by sequence.
- A batch with truncated completions, masked, gives exactly the loss, normaliser and gradients of the batch
  without them, and logs the share it left out; halving the micro-batch leaves the step's gradient unchanged.
- A tiny run with both options logs finite losses; refusals of values that make no sense.
- CISPO and SAPO against TRL's ``_compute_loss`` with its ``cispo`` and ``sapo`` loss types the same way (in this
  file: importing TRL's trainer costs a test process tens of seconds, once); at ratio 1 both give the clip's
  gradient; a tiny run with each.
- ``delta`` (two-sided clipping), ``off_policy_mask_threshold`` and ``bias_correction_kl`` against TRL's
  ``_compute_loss`` with its options of those names, each shown to act on the case.
- RLOO (``baseline: leave_one_out``, ``importance_sampling_level: sequence_sum``, ``loss_aggregation:
  sequence``) against TRL's ``RLOOTrainer._compute_loss`` the same way; ``kl_in_reward`` on a real model
  against the rewards less beta times the summed log-ratio written out; a tiny run with both.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from run_support import compose_run
from test_grpo_loss import LENGTHS, REWARDS, G, fixed_inputs
from test_grpo_training import llama_grpo, records, vowel_config, write  # noqa: F401  (a fixture and helpers)

from posttune_grpo.loss import aggregate, group_advantages, policy_loss, tis_weights

TOL = 1e-6
#: posttune's loss_aggregation -> TRL's loss_type computing the same normaliser on one micro-batch
TRL_LOSS_TYPE = {"token": "dapo", "sequence": "grpo", "constant": "dr_grpo"}
MAX_NEW_TOKENS = 8
#: clip ranges by ratio level: PPO's and DAPO's for tokens, GSPO's for sequences (a sequence's mean log-ratio
#: moves far less than a token's)
EPSILONS = {"token": (0.2, 0.28), "sequence": (3e-4, 4e-4)}
CASES = {  # name: (old log-probs used, beta, truncated importance weights)
    "first_pass": (False, 0.0, False),
    "clipped": (True, 0.0, False),
    "clipped_kl": (True, 0.04, False),
    "clipped_kl_tis": (True, 0.04, True),
}


class OneProcess:
    """TRL's accelerator, for one process: gathering and reducing leave a tensor as it is."""

    num_processes = 1

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def reduce(self, value: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return value

    def pad_across_processes(self, value: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return value


def trl_loss(logps: torch.Tensor, inputs: dict[str, torch.Tensor], *, loss_type: str, level: str, epsilon: float,
             epsilon_high: float, beta: float, old: torch.Tensor | None, is_weights: torch.Tensor | None,
             mask: torch.Tensor, delta: float | None = None, off_policy_threshold: float | None = None,
             sampling: torch.Tensor | None = None, bias_correction_kl: bool = False,
             entropies: torch.Tensor | None = None, top_entropy_quantile: float = 1.0,
             logged: dict | None = None) -> torch.Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` itself on these tensors: a stand-in trainer whose forward returns
    ``logps`` (the completion positions are the columns; ``mask`` is TRL's completion mask). One process, one
    micro-batch, no accumulation; ``use_bias_correction_kl`` off unless asked (posttune's default KL term is not
    weighted by the ratio); per-token importance weights are TRL's ``vllm_importance_sampling_mode:
    token_truncate``; ``sampling``: the sampler's log-probs its off-policy mask reads; ``entropies``: what its
    forward returns as each position's entropy, which its ``top_entropy_quantile`` reads."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="the reference is TRL's GRPO trainer")
    rows, width = logps.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (
            logps, torch.zeros_like(logps) if entropies is None else entropies, None),
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=off_policy_threshold,
        importance_sampling_level=level,
        beta=beta, loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon_high,
        max_completion_length=MAX_NEW_TOKENS,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_correction_kl, steps_per_generation=1,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
        use_vllm=is_weights is not None, vllm_importance_sampling_correction=is_weights is not None,
        get_off_policy_mask=grpo_trainer.GRPOTrainer.get_off_policy_mask,  # a static method
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, accelerator=OneProcess(), _metrics=defaultdict(lambda: defaultdict(list)))
    trainer.get_high_entropy_mask = types.MethodType(grpo_trainer.GRPOTrainer.get_high_entropy_mask, trainer)
    batch: dict[str, Any] = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, width, dtype=torch.long), "completion_mask": mask,
        "advantages": inputs["advantages"], "num_items_in_batch": mask.sum(),
    }
    if old is not None:
        batch["old_per_token_logps"] = old
    if beta:
        batch["ref_per_token_logps"] = inputs["ref"]
    if is_weights is not None:
        batch["importance_sampling_ratio"] = is_weights
    if sampling is not None:
        batch["sampling_per_token_logps"] = sampling
    loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, batch)
    if logged is not None:  # what TRL logs of this step: metric -> its value
        logged.update({key: values[-1] for key, values in trainer._metrics["train"].items()})
    return loss


def case_tensors(case: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, float, torch.Tensor | None]:
    inputs = fixed_inputs()
    with_old, beta, with_tis = CASES[case]
    old = inputs["old"] if with_old else None
    is_weights = None
    if with_tis:
        behaviour = inputs["old"] + torch.randn(inputs["old"].shape, generator=torch.Generator().manual_seed(3)) * 0.8
        is_weights = tis_weights(inputs["old"], behaviour, inputs["mask"], 2.0)
    return inputs, old, beta, is_weights


def check_against_trl(case: str, level: str, how: str, loss_type: str, objective: str = "clip") -> tuple[Any, Any, Any]:
    """posttune's loss and gradient equal TRL's ``loss_type`` on case ``case``; (the loss, the mask, old log-probs)."""
    inputs, old, beta, is_weights = case_tensors(case)
    epsilon, epsilon_high = EPSILONS[level]
    mask = inputs["mask"]
    ours_logps = inputs["logps"].clone().requires_grad_()
    result = policy_loss(ours_logps, old, inputs["advantages"], mask, epsilon=epsilon, epsilon_high=epsilon_high,
                         ref_logps=inputs["ref"] if beta else None, beta=beta, is_weights=is_weights, level=level,
                         objective=objective)
    loss_sum, normaliser = aggregate(result.per_token, mask, how, MAX_NEW_TOKENS, torch.ones(len(LENGTHS)))
    (loss_sum / normaliser).backward()

    theirs_logps = inputs["logps"].clone().requires_grad_()
    # TRL's cispo caps the weight at epsilon_high itself; posttune's cap is 1 + epsilon_high, as the clip's bound
    theirs = trl_loss(theirs_logps, inputs, loss_type=loss_type, level=level, epsilon=epsilon,
                      epsilon_high=1 + epsilon_high if objective == "cispo" else epsilon_high, beta=beta, old=old,
                      is_weights=is_weights, mask=mask)
    theirs.backward()
    torch.testing.assert_close(loss_sum / normaliser, theirs.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, atol=TOL, rtol=0)
    return result, mask, old


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_and_gradient_equal_trls_compute_loss(level, how, case):
    result, mask, old = check_against_trl(case, level, how, TRL_LOSS_TYPE[how])
    clipped_sequences = result.clipped.amax(dim=1)
    if old is not None and level == "sequence":  # the sequence-level clip was active on some completions, not all
        assert 0 < float(clipped_sequences.sum()) < len(LENGTHS)
        assert bool(((result.clipped == clipped_sequences.unsqueeze(1)) | (mask == 0)).all())  # whole sequences


def direct_gspo(logps, old, ref, mask, advantages, *, epsilon, epsilon_high, beta, how, max_new_tokens):
    """GSPO (Zheng et al. 2025, eq. 5-7) sequence by sequence, in a Python loop: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)
    = exp(mean_t(logp - logp_old)); the completion's term -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i) stands
    for each of its tokens (TRL's broadcast), beside each token's k3 KL; then the aggregation."""
    total, normaliser = 0.0, 0.0
    for i in range(logps.shape[0]):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t] > 0]
        log_ratio = sum(logps[i, t] - (logps[i, t].detach() if old is None else old[i, t]) for t in tokens)
        ratio = torch.exp(log_ratio / len(tokens))
        term = -torch.minimum(ratio * advantages[i], torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages[i])
        summed = term * len(tokens)
        if beta:
            summed = summed + beta * sum(torch.exp(ref[i, t] - logps[i, t]) - (ref[i, t] - logps[i, t]) - 1
                                         for t in tokens)
        if how == "token":
            total, normaliser = total + summed, normaliser + len(tokens)
        elif how == "sequence":
            total, normaliser = total + summed / len(tokens), normaliser + 1
        else:
            total, normaliser = total + summed / max_new_tokens, normaliser + 1
    return total / normaliser


@pytest.mark.parametrize("epsilons", [(0.2, 0.28), (3e-4, 4e-4)], ids=["ppo_range", "gspo_range"])
@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no_kl", "kl"])
def test_sequence_level_loss_and_gradient_equal_gspos_formula(beta, how, epsilons):
    inputs = fixed_inputs()
    epsilon, epsilon_high = epsilons
    settings = dict(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)
    ref = inputs["ref"] if beta else None
    ours_logps = inputs["logps"].clone().requires_grad_()
    result = policy_loss(ours_logps, inputs["old"], inputs["advantages"], inputs["mask"], ref_logps=ref,
                         level="sequence", **settings)
    loss_sum, normaliser = aggregate(result.per_token, inputs["mask"], how, MAX_NEW_TOKENS, torch.ones(len(LENGTHS)))
    (loss_sum / normaliser).backward()
    theirs_logps = inputs["logps"].clone().requires_grad_()
    expected = direct_gspo(theirs_logps, inputs["old"], ref, inputs["mask"], inputs["advantages"], how=how,
                           max_new_tokens=MAX_NEW_TOKENS, **settings)
    expected.backward()
    torch.testing.assert_close(loss_sum / normaliser, expected.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, atol=TOL, rtol=0)


def test_one_pass_sequence_ratio_is_one_and_its_gradient_is_the_mean_of_the_tokens():
    """``num_iterations: 1``: no old log-probs, the ratio's value is 1 and nothing is clipped, but the gradient
    flows through it: each token gets -A_i / |o_i| (sequence aggregation: / N); the same update as the
    token-level ratio then, for every aggregation (without importance weights)."""
    inputs = fixed_inputs()
    mask = inputs["mask"]
    grads = {}
    for level in ("token", "sequence"):
        for how in ("token", "sequence", "constant"):
            logps = inputs["logps"].clone().requires_grad_()
            result = policy_loss(logps, None, inputs["advantages"], mask, epsilon=3e-4, epsilon_high=4e-4, level=level)
            assert float(result.clipped.sum()) == 0.0
            loss_sum, normaliser = aggregate(result.per_token, mask, how, MAX_NEW_TOKENS, torch.ones(len(LENGTHS)))
            (loss_sum / normaliser).backward()
            grads[level, how] = logps.grad
    lengths = mask.sum(dim=1, keepdim=True)
    expected = -(inputs["advantages"].unsqueeze(1) * mask) / lengths / len(LENGTHS)
    torch.testing.assert_close(grads["sequence", "sequence"], expected, atol=TOL, rtol=0)
    for how in ("token", "sequence", "constant"):
        torch.testing.assert_close(grads["sequence", how], grads["token", how], atol=TOL, rtol=0)


# -- mask_truncated_completions on a real (tiny) model ------------------------------------------------------------

TRUNCATED = [1, 2, 6]  # rows marked as cut off at max_new_tokens (the loss reads only the flag)


def rows_of(batch: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The micro-batch with only rows ``keep`` (every per-row tensor and per-reward value)."""
    index = torch.tensor(keep)
    out = {key: value[index] if isinstance(value, torch.Tensor) and value.dim() else value
           for key, value in batch.items() if key != "per_reward"}
    out["per_reward"] = {name: values[index] for name, values in batch["per_reward"].items()}
    return out


def loss_and_grads(session: Any, batches: list[dict[str, Any]]) -> tuple[Any, dict[str, torch.Tensor], list[Any]]:
    """The step the trainer takes over ``batches``: the summed loss divided once by the summed normaliser."""
    session.model.zero_grad(set_to_none=True)
    outs = [session.plan.method.descriptor.loss(session, batch) for batch in batches]
    loss_sum = sum(out.loss_sum for out in outs)
    normaliser = sum(out.normaliser for out in outs)
    (loss_sum / normaliser).backward()
    return (loss_sum, normaliser), {n: p.grad.clone() for n, p in session.model.named_parameters()}, outs


@pytest.fixture
def truncated_session(llama_grpo, tmp_path):  # noqa: F811
    """A composed run's first generation batch (8 completions), old log-probs moved so that ratios clip, and
    rows ``TRUNCATED`` marked as truncated."""
    from posttune_grpo.method import batches

    def make(**method: Any) -> tuple[Any, Any]:
        config = vowel_config(tmp_path / "_".join(f"{k}-{v}" for k, v in method.items()),
                              method={"num_iterations": 2, "beta": 0.04, **method})
        session = compose_run(config)
        next(iter(batches(session)))
        rollouts = session.method_state.pending
        mask = (rollouts.labels != -100).float()
        noise = torch.randn(rollouts.old_logps.shape, generator=torch.Generator().manual_seed(1)) * 0.3
        rollouts.old_logps = rollouts.old_logps + noise * mask
        rollouts.truncated = torch.zeros(len(rollouts))
        rollouts.truncated[TRUNCATED] = 1.0
        return session, rollouts

    return make


@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_truncated_completions_give_the_loss_of_the_batch_without_them(truncated_session, level, how):
    session, rollouts = truncated_session(importance_sampling_level=level, loss_aggregation=how)
    (batch,) = rollouts.micro_batches(len(rollouts))
    assert float(rollouts.advantages[TRUNCATED].abs().sum()) > 0  # they would have trained
    config = session.method_config
    session.method_config = dataclasses.replace(config, mask_truncated_completions=True)
    (masked_sum, masked_n), masked_grads, (out,) = loss_and_grads(session, [batch])
    session.method_config = dataclasses.replace(config, mask_truncated_completions=False)
    kept = [row for row in range(len(rollouts)) if row not in TRUNCATED]
    (kept_sum, kept_n), kept_grads, _ = loss_and_grads(session, [rows_of(batch, kept)])
    (_, all_n), _, (unmasked,) = loss_and_grads(session, [batch])

    expected_n = len(kept) if how != "token" else float((batch["labels"][kept] != -100).sum())
    assert float(masked_n) == float(kept_n) == expected_n and float(all_n) > expected_n
    torch.testing.assert_close(masked_sum, kept_sum, atol=TOL, rtol=0)
    for name, grad in kept_grads.items():
        torch.testing.assert_close(masked_grads[name], grad, atol=TOL, rtol=0, msg=name)
    total, count = out.metrics["truncated_masked"]
    assert (float(total), float(count)) == (len(TRUNCATED), len(rollouts))
    assert "truncated_masked" not in unmasked.metrics
    # what the policy produced still counts every completion: the reward and truncation statistics
    for key in ("reward", "truncated", "completion_length"):
        torch.testing.assert_close(out.metrics[key][0], unmasked.metrics[key][0], atol=0, rtol=0)
    assert float(out.metrics["truncated"][0]) == len(TRUNCATED)


def test_a_completion_already_left_out_is_not_counted_as_masked(truncated_session):
    """With ``filter_equal_rewards`` a truncated completion of a tied group was out already: not counted again."""
    session, rollouts = truncated_session(mask_truncated_completions=True)
    rollouts.weights[[0, 1, 2, 3]] = 0.0  # the first group, as if it tied
    (batch,) = rollouts.micro_batches(len(rollouts))
    total, count = session.plan.method.descriptor.loss(session, batch).metrics["truncated_masked"]
    assert (float(total), float(count)) == (1, len(rollouts))  # row 6 only


@pytest.mark.parametrize("layout", [{"padding_free": False}, {}], ids=["padded", "padding_free"])
@pytest.mark.parametrize("how", ["token", "sequence"])
def test_halving_the_micro_batch_gives_the_same_step(truncated_session, how, layout):
    """Sequence-level ratios and masked truncated completions, micro_batch_size 8 -> 4 (two forwards, one
    division by the summed normaliser): the same loss, normaliser, metrics and gradients."""
    session, rollouts = truncated_session(importance_sampling_level="sequence", mask_truncated_completions=True,
                                          loss_aggregation=how, epsilon=3e-4, epsilon_high=4e-4, **layout)
    (whole_sum, whole_n), whole_grads, (whole,) = loss_and_grads(session, rollouts.micro_batches(8))
    (half_sum, half_n), half_grads, halves = loss_and_grads(session, rollouts.micro_batches(4))
    assert float(half_n) == float(whole_n) and float(whole_sum.detach()) != 0.0
    torch.testing.assert_close(half_sum, whole_sum, atol=TOL, rtol=0)
    for key, (total, count) in whole.metrics.items():
        for part, whole_value in enumerate((total, count)):
            halved = float(sum(h.metrics[key][part].detach() for h in halves))
            assert halved == pytest.approx(float(whole_value.detach()), abs=1e-5), key
    assert 0 < float(whole.metrics["clip_fraction"][0]) < float(whole.metrics["clip_fraction"][1])
    for name, grad in whole_grads.items():
        torch.testing.assert_close(half_grads[name], grad, atol=TOL, rtol=0, msg=name)


def test_a_gspo_run_logs_finite_losses_and_clips_whole_completions(llama_grpo, posttune_cli, tmp_path):  # noqa: F811
    """Sequence-level ratios with GSPO's clip range, KL, 2 optimizer steps per generation batch (the second's
    ratio is not 1): every step's loss finite and a real gradient; the second steps clip some completions."""
    config = vowel_config(tmp_path, method={"importance_sampling_level": "sequence", "epsilon": 3e-4,
                                            "epsilon_high": 4e-4, "num_iterations": 2, "beta": 0.04,
                                            "loss_aggregation": "sequence"},
                          train={"max_steps": 4, "lr": 5e-3})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = records(config)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for step in steps:
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0 and step["completions"] == 8
        assert "truncated_masked" not in step
    assert steps[0]["clip_fraction"] == steps[2]["clip_fraction"] == 0.0  # a generation batch's first step: ratio 1
    assert any(step["clip_fraction"] > 0 for step in steps[1::2])
    assert all(step["clip_fraction"] in {i / 8 for i in range(9)} for step in steps)  # a share of 8 completions


def test_a_run_whose_completions_are_all_truncated_trains_on_none_of_them(llama_grpo, posttune_cli,  # noqa: F811
                                                                           tmp_path):
    """The random tiny model never stops within 6 tokens: with mask_truncated_completions every completion is
    left out, the normaliser is 0, the loss and gradient 0 (no NaN), and the logged shares say why."""
    config = vowel_config(tmp_path, method={"importance_sampling_level": "sequence", "mask_truncated_completions": True,
                                            "loss_aggregation": "sequence"}, train={"max_steps": 2})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    for step in records(config):
        assert step["truncated"] == step["truncated_masked"] == 1.0
        assert step["completions"] == 0 and step["loss"] == 0.0 and step["grad_norm"] == 0.0
        assert step["reward"] > 0  # the rewards are still scored and logged


@pytest.mark.parametrize("method, message", [
    ({"importance_sampling_level": "sentence"},
     "config: method.importance_sampling_level: expected one of 'token', 'sequence', 'sequence_sum', got 'sentence' "
     "(did you mean 'sequence'?)"),
    ({"mask_truncated_completions": "maybe"}, "config: method.mask_truncated_completions: expected true or false, "
                                              "got 'maybe'"),
])
def test_values_that_make_no_sense_are_refused(llama_grpo, posttune_cli, tmp_path, method, message):  # noqa: F811
    result = posttune_cli("validate", str(write(tmp_path, vowel_config(tmp_path, method=method))))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"posttune: error: {message}")


def test_iterations_inside_one_optimizer_step_are_refused(llama_grpo, posttune_cli, tmp_path):  # noqa: F811
    """Passes over a generation batch help only across optimizer steps: inside one the policy has not moved, so a
    second pass is the first one's gradient again at twice the compute (its ratios are 1, and the old log-probs
    are not even taken), while reward_std's sample correction counted the completions twice."""
    config = vowel_config(tmp_path, method={"num_iterations": 2, "micro_batch_size": 4}, train={"grad_accum_steps": 4})
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr == ("posttune: error: config: method.num_iterations: its 2 passes over a generation batch of "
                             "2 micro-batches must fall in different optimizer steps, but train.grad_accum_steps 4 "
                             "puts a micro-batch twice in one step (the same gradient again); set "
                             "train.grad_accum_steps to at most 2\n")
    config["train"]["grad_accum_steps"] = 2
    assert posttune_cli("validate", str(write(tmp_path, config))).exit_code == 0


def test_adapter_dropout_is_refused_for_grpo(llama_grpo, posttune_cli, tmp_path):  # noqa: F811
    """The ratio's old log-probs are taken without dropout: with it, first-pass ratios were 0.7 to 1.2 and a quarter
    of the tokens clipped before any update (a PPO audit; GRPO shares the path)."""
    config = vowel_config(tmp_path, adapter={"rank": 4, "dropout": 0.1})
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr == ("posttune: error: config: adapter.dropout: grpo compares the policy's log-probs with "
                             "those it gave without dropout, which dropout would set apart before any update; set "
                             "adapter.dropout: 0 (TRL disables dropout for it too)\n")


#: the aggregation of TRL's loss type: cispo divides by the batch's tokens (posttune's token), sapo takes
#: each completion's mean and then their mean (sequence)
AGGREGATION = {"cispo": "token", "sapo": "sequence"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("objective", ["cispo", "sapo"])
def test_cispo_and_sapo_loss_and_gradient_equal_trls_compute_loss(objective, level, case):
    result, mask, old = check_against_trl(case, level, AGGREGATION[objective], objective, objective)
    capped = float((result.clipped * mask).sum())
    if objective == "cispo" and old is not None:  # the cap acted on some tokens, not all: the comparison sees it
        assert 0 < capped < float(mask.sum())
    elif objective == "sapo":
        assert capped == 0


def test_on_policy_both_give_the_policy_gradient_of_the_clip():
    """At ratio 1 (one pass per batch) CISPO's and SAPO's gradients are REINFORCE's, as the clip's is."""
    inputs, _, _, _ = case_tensors("first_pass")
    grads = []
    for objective in ("clip", "cispo", "sapo"):
        logps = inputs["logps"].clone().requires_grad_()
        result = policy_loss(logps, None, inputs["advantages"], inputs["mask"], epsilon=0.2, objective=objective)
        result.per_token.sum().backward()
        grads.append(logps.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-6, rtol=0)


#: TRL's RLOOTrainer, in GRPO's settings (docs/grpo.md, "RLOO")
RLOO = {"baseline": "leave_one_out", "scale_rewards": "none", "importance_sampling_level": "sequence_sum",
        "loss_aggregation": "sequence"}


#: and with TRL's RLOO default KL penalty in the reward
RLOO_KL = {**RLOO, "beta": 0.05, "kl_in_reward": True}


#: TRL's further options on the clip objective, all at once
CLIP_OPTIONS = {"delta": 1.5, "off_policy_mask_threshold": 0.05, "beta": 0.04, "bias_correction_kl": True}


@pytest.mark.parametrize("method", [{"objective": "cispo"}, {"objective": "sapo"}, RLOO_KL, CLIP_OPTIONS],
                         ids=["cispo", "sapo", "rloo", "clip_options"])
def test_a_run_with_each_objective_trains_and_logs_finite_losses(llama_grpo, posttune_cli, tmp_path,  # noqa: F811
                                                                  method):
    # RLOO's ratio is the whole completion's: at the tiny model's default rate the second pass clips every
    # completion that has an advantage (no gradient left), at a smaller one it keeps some
    lr = {"lr": 1e-4} if method is RLOO_KL else {}
    config = vowel_config(tmp_path, method={**method, "num_iterations": 2}, train={"max_steps": 2, **lr})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    logged = records(config)
    assert [r["step"] for r in logged] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in logged)
    if method.get("objective") == "sapo":
        assert all(r["clip_fraction"] == 0.0 for r in logged)  # a gate, no hard clip
    if method is RLOO_KL:  # one ratio per completion: a share of the 8 completions; the KL logged
        assert all(r["clip_fraction"] in {i / 8 for i in range(9)} for r in logged)
        assert all(math.isfinite(r["kl"]) for r in logged) and logged[0]["kl"] == 0.0  # step 1: the reference
    if method is CLIP_OPTIONS:  # the off-policy mask's share is logged
        assert all(0.0 <= r["off_policy_masked"] <= 1.0 for r in logged)


def trl_rloo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, old: torch.Tensor | None, *,
                  epsilon: float, epsilon_high: float) -> torch.Tensor:
    """TRL's ``RLOOTrainer._compute_loss`` itself, its forward replaced by ``logps`` (as ``trl_loss``): the old
    log-probs are summed per completion first, as its generation step does."""
    rloo_trainer = pytest.importorskip("trl.trainer.rloo_trainer", reason="the reference is TRL's RLOO trainer")
    rows, width = logps.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
        epsilon_low=epsilon, epsilon_high=epsilon_high, model=SimpleNamespace(training=True), aux_loss_enabled=False,
        accelerator=OneProcess(), _metrics=defaultdict(lambda: defaultdict(list)))
    batch = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, width, dtype=torch.long), "completion_mask": mask,
        "old_logps": ((logps.detach() if old is None else old) * mask).sum(1), "advantages": advantages,
    }
    return rloo_trainer.RLOOTrainer._compute_loss(trainer, None, batch)


@pytest.mark.parametrize("case", ["first_pass", "clipped"])
def test_rloo_loss_and_gradient_equal_trls_rloo_trainer(case):
    """RLOO's settings give TRL's RLOO loss and gradient: the leave-one-out advantages (the formula's, in
    test_grpo_loss.py), the completion's whole likelihood ratio clipped, the mean over completions. Clipped:
    the old log-probs move the ratios past the clip for some completions, not all."""
    inputs, old, _, _ = case_tensors(case)
    advantages = group_advantages(torch.tensor(REWARDS), G, "none", baseline="leave_one_out")[0]
    mask = inputs["mask"]
    ours = inputs["logps"].clone().requires_grad_()
    result = policy_loss(ours, old, advantages, mask, epsilon=0.2, level="sequence_sum")
    loss_sum, normaliser = aggregate(result.per_token, mask, "sequence", MAX_NEW_TOKENS, torch.ones(len(LENGTHS)))
    (loss_sum / normaliser).backward()
    theirs = inputs["logps"].clone().requires_grad_()
    reference = trl_rloo_loss(theirs, advantages, mask, old, epsilon=0.2, epsilon_high=0.2)
    reference.backward()
    torch.testing.assert_close(loss_sum / normaliser, reference.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=TOL, rtol=0)
    clipped = float(result.clipped.amax(dim=1).sum())
    if old is None:  # ratio 1: REINFORCE on the whole completion, -A_i / n on each of its tokens
        assert clipped == 0
        expected = -advantages.unsqueeze(1) * mask / len(LENGTHS)
        torch.testing.assert_close(ours.grad, expected, atol=TOL, rtol=0)
    else:
        assert 0 < clipped < len(LENGTHS)


@pytest.mark.parametrize(("method", "message"), [
    ({"objective": "cispo", "epsilon_high": -1.0}, "method.epsilon_high: expected a number >= 0, got -1.0"),
    ({"objective": "sapo", "sapo_temperature_neg": 0.0}, "method.sapo_temperature_neg: expected a positive number"),
    ({"objective": "ppo"}, "method.objective"),
    ({"kl_in_reward": True}, "method.kl_in_reward: puts beta times the KL in the reward, and beta is 0: set "
                             "method.beta (TRL's RLOO uses 0.05)"),
    ({"objective": "sapo", "delta": 2.0}, "method.delta: caps the clip objective's ratio; objective sapo has no such "
                                          "term: remove it"),
    ({"delta": 1.1}, "method.delta: must be above 1 + epsilon_high (the clip's upper bound, 1.2), got 1.1"),
    ({"bias_correction_kl": True}, "method.bias_correction_kl: weights the loss's KL term, and this run has none "
                                   "(beta 0, or kl_in_reward): remove it"),
    ({"off_policy_mask_threshold": -1.0}, "method.off_policy_mask_threshold: expected a number >= 0, got -1.0"),
])
def test_bad_objective_settings_are_refused(llama_grpo, posttune_cli, tmp_path, method, message):  # noqa: F811
    result = posttune_cli("validate", str(write(tmp_path, vowel_config(tmp_path, method=method))))
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_kl_in_reward_takes_the_summed_log_ratio_from_the_reward_before_the_baseline(llama_grpo,  # noqa: F811
                                                                                     tmp_path):
    """TRL's RLOO: r_i - beta * sum_t(logp_it - ref_it), then the leave-one-out baseline, written out here from
    plain forwards of the policy (moved off its reference) and the reference; the loss then has no KL term of
    its own (its value is the surrogate's alone) and logs the penalty's log-ratio per token as ``kl``."""
    from posttune_grpo.method import batches

    beta = 0.5
    session = compose_run(vowel_config(tmp_path, method={**RLOO, "beta": beta, "kl_in_reward": True}))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in session.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    batch = next(iter(batches(session)))
    rollouts = session.method_state.pending
    mask = (rollouts.labels != -100).float()

    def summed_logps(model: Any) -> torch.Tensor:
        with torch.no_grad():
            logits = model(rollouts.input_ids).float()
        logps = logits.log_softmax(-1).gather(-1, rollouts.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (logps * mask).sum(dim=1)

    kl = summed_logps(session.model) - summed_logps(session.models["reference"])
    assert bool((kl.abs() > 1e-3).all())  # the penalty acts on every completion
    penalised = (rollouts.rewards - beta * kl).tolist()
    expected = []
    for i, reward in enumerate(penalised):
        others = [penalised[j] for j in range(i - i % G, i - i % G + G) if j != i]
        expected.append(reward - sum(others) / len(others))
    torch.testing.assert_close(rollouts.kl, kl, atol=1e-4, rtol=0)
    torch.testing.assert_close(rollouts.advantages, torch.tensor(expected), atol=1e-4, rtol=0)

    out = session.plan.method.descriptor.loss(session, batch)
    # ratio 1: each completion's term is -A_i, and nothing else (a KL term would add beta times a positive k3)
    assert float(out.loss_sum.detach()) == pytest.approx(-float((batch["advantages"] * batch["weights"]).sum()),
                                                         abs=1e-6)
    kl_sum, tokens = out.metrics["kl"]
    assert float(kl_sum) == pytest.approx(float(kl.sum()), abs=1e-3) and float(tokens) == float(mask.sum())


#: the options, by ratio level, and what each does on case "clipped_kl": a delta above the clip's upper bound
#: (GSPO's is 1.0004), a threshold some completions' drift passes
TRL_OPTIONS = {"delta": {"token": 1.5, "sequence": 1.002}, "off_policy_threshold": {"token": 0.1, "sequence": 0.1},
               "bias_correction_kl": {"token": True, "sequence": True}}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("option", list(TRL_OPTIONS))
def test_two_sided_clipping_off_policy_masking_and_kl_correction_equal_trls(option, level):
    inputs, old, beta, _ = case_tensors("clipped_kl")
    mask, epsilon, epsilon_high = inputs["mask"], *EPSILONS[level]
    sampler = inputs["logps"] + torch.randn(mask.shape, generator=torch.Generator().manual_seed(5)) * 0.3
    value = TRL_OPTIONS[option][level]
    results = []
    for options in ({}, {option: value}):
        ours_logps = inputs["logps"].clone().requires_grad_()
        result = policy_loss(ours_logps, old, inputs["advantages"], mask, epsilon=epsilon, epsilon_high=epsilon_high,
                             ref_logps=inputs["ref"], beta=beta, level=level, behaviour_logps=sampler, **options)
        loss_sum, normaliser = aggregate(result.per_token, mask, "token", MAX_NEW_TOKENS, torch.ones(len(LENGTHS)))
        (loss_sum / normaliser).backward()
        results.append((loss_sum / normaliser, ours_logps.grad, result))
    (plain, _, _), (ours, ours_grad, result) = results
    assert abs(float(ours.detach()) - float(plain.detach())) > 1e-4  # the option acts on this case

    theirs_logps, logged = inputs["logps"].clone().requires_grad_(), {}
    theirs = trl_loss(theirs_logps, inputs, loss_type="dapo", level=level, epsilon=epsilon, epsilon_high=epsilon_high,
                      beta=beta, old=old, is_weights=None, mask=mask, sampling=sampler, logged=logged,
                      **{option: value})
    theirs.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours_grad, theirs_logps.grad, atol=TOL, rtol=0)
    # the KL logged is the estimate the loss takes (with the correction: times the ratio; it logged the plain k3)
    assert float((result.kl * mask).sum() / mask.sum()) == pytest.approx(logged["kl"], abs=1e-6)
    if option == "off_policy_threshold":  # some completions dropped, all of them with a negative advantage
        assert 0 < float(result.dropped.sum()) < len(LENGTHS)
        assert bool((inputs["advantages"][result.dropped > 0] < 0).all())
