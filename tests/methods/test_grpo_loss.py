"""The GRPO objective against a direct implementation of each formula, written token by token.

On fixed completions, rewards and log-probabilities: advantages (group, batch, none; the group's mean or
RLOO's leave-one-out baseline), the clipped
surrogate with and without clipping active, with and without the k3 KL, and each aggregation
(token, sequence, constant) -- losses and gradients equal within 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttune_grpo.loss import STD_EPS, aggregate, group_advantages, policy_loss, tis_weights

TOL = 1e-6
G = 4
LENGTHS = [3, 5, 2, 4, 6, 1, 4, 3]  # completion tokens of 8 completions (2 groups of 4)
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0]  # the second group: all equal


def direct_advantages(rewards: list[float], scale: str, baseline: str = "mean") -> list[float]:
    """Completion by completion; ``leave_one_out`` as Kool et al. 2019 and Ahmadian et al. 2024 (RLOO) write it:
    ``r_i - 1 / (G - 1) * sum_{j != i} r_j``."""
    out = []
    everything = rewards
    mean_all = sum(everything) / len(everything)
    std_all = math.sqrt(sum((r - mean_all) ** 2 for r in everything) / (len(everything) - 1))
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        for i, r in enumerate(group):
            others = [group[j] for j in range(G) if j != i]
            centred = r - (sum(others) / len(others) if baseline == "leave_one_out" else mean)
            if scale == "group":
                out.append(centred / (std + STD_EPS))
            elif scale == "batch":
                out.append(centred / (std_all + STD_EPS))
            else:
                out.append(centred)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_advantages_normalise_within_each_group(scale, baseline):
    rewards = torch.tensor(REWARDS)
    batch_std = rewards.std() if scale == "batch" else None
    advantages, equal = group_advantages(rewards, G, scale, batch_std, baseline)
    assert advantages.tolist() == pytest.approx(direct_advantages(REWARDS, scale, baseline), abs=TOL)
    assert equal.tolist() == [False] * 4 + [True] * 4


def test_leave_one_out_is_the_mean_centred_advantage_scaled_by_g_over_g_minus_1():
    """RLOO's advantage is GRPO's (unscaled) times G / (G - 1): the same direction, a larger step, and a
    completion's own reward no longer in its baseline (with G = 2, the other completion's reward)."""
    rewards = torch.tensor([0.3, 1.0, 0.0, 0.9, 2.0, -1.0, 0.5, 0.5])
    mean_centred, _ = group_advantages(rewards, G, "none")
    loo, _ = group_advantages(rewards, G, "none", baseline="leave_one_out")
    torch.testing.assert_close(loo, mean_centred * G / (G - 1), atol=TOL, rtol=0)
    pairs, _ = group_advantages(rewards, 2, "none", baseline="leave_one_out")
    assert pairs.tolist() == pytest.approx([-0.7, 0.7, -0.9, 0.9, 3.0, -3.0, 0.0, 0.0], abs=TOL)
    with pytest.raises(ValueError, match="unknown baseline 'median'"):
        group_advantages(rewards, G, "none", baseline="median")


def fixed_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    length = max(LENGTHS) + 2
    mask = torch.zeros(len(LENGTHS), length)
    for row, n in enumerate(LENGTHS):
        mask[row, 1:1 + n] = 1.0  # the completion's targets start after the prompt
    logps = -torch.rand(len(LENGTHS), length, generator=generator) * 3
    return {
        "logps": logps,
        "old": logps + torch.randn(logps.shape, generator=generator) * 0.4,  # ratios well beyond 1 +- 0.2
        "ref": logps + torch.randn(logps.shape, generator=generator) * 0.3,
        "mask": mask,
        "advantages": group_advantages(torch.tensor(REWARDS), G, "group")[0],
    }


def direct_loss(logps, old, ref, mask, advantages, *, epsilon, epsilon_high, beta, how, max_new_tokens, weights,
                behaviour=None, cap=None):
    """Token by token, as the papers write it (a Python loop, no shared code with posttune_grpo); with
    ``behaviour``, each surrogate times the truncated importance weight min(pi_old / pi_behaviour, cap)."""
    total, normaliser = 0.0, 0.0
    for i in range(logps.shape[0]):
        per_sequence = 0.0
        tokens = 0
        for t in range(logps.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio = torch.exp(logps[i, t] - (logps[i, t].detach() if old is None else old[i, t]))
            surrogate = ratio * advantages[i]
            clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages[i]
            term = -torch.minimum(surrogate, clipped)
            if behaviour is not None:
                term = term * min(math.exp(float(old[i, t] - behaviour[i, t])), cap)
            if ref is not None and beta:
                term = term + beta * (torch.exp(ref[i, t] - logps[i, t]) - (ref[i, t] - logps[i, t]) - 1)
            per_sequence = per_sequence + term
            tokens += 1
        if weights[i] == 0:
            continue
        if how == "token":
            total, normaliser = total + per_sequence, normaliser + tokens
        elif how == "sequence":
            total, normaliser = total + per_sequence / tokens, normaliser + 1
        else:
            total, normaliser = total + per_sequence / max_new_tokens, normaliser + 1
    return total / normaliser


@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
@pytest.mark.parametrize("kl", [False, True], ids=["no_kl", "kl"])
@pytest.mark.parametrize("clipping", [False, True], ids=["first_pass", "clipped"])
def test_loss_and_gradient_equal_the_direct_formula(how, kl, clipping):
    inputs = fixed_inputs()
    weights = torch.tensor([1.0] * 7 + [0.0])  # the last completion is left out (e.g. a placeholder)
    settings = dict(epsilon=0.2, epsilon_high=0.28, beta=0.04 if kl else 0.0)
    old = inputs["old"] if clipping else None
    ref = inputs["ref"] if kl else None

    ours_logps = inputs["logps"].clone().requires_grad_()
    result = policy_loss(ours_logps, old, inputs["advantages"], inputs["mask"], ref_logps=ref, **settings)
    loss_sum, normaliser = aggregate(result.per_token, inputs["mask"], how, 8, weights)
    (loss_sum / normaliser).backward()

    theirs_logps = inputs["logps"].clone().requires_grad_()
    expected = direct_loss(theirs_logps, old, ref, inputs["mask"], inputs["advantages"], how=how,
                           max_new_tokens=8, weights=weights, **settings)
    expected.backward()
    torch.testing.assert_close(loss_sum / normaliser, expected.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, atol=TOL, rtol=0)
    if clipping:
        assert 0 < float(result.clipped.sum()) < float(inputs["mask"].sum())  # clipping was really active
    assert (result.kl is not None) == kl


def test_one_pass_without_kl_is_reinforce_with_group_normalised_advantages():
    """num_iterations 1, beta 0: the gradient of each token's log-prob is -A_i / normaliser."""
    inputs = fixed_inputs()
    weights = torch.ones(len(LENGTHS))
    logps = inputs["logps"].clone().requires_grad_()
    result = policy_loss(logps, None, inputs["advantages"], inputs["mask"], epsilon=0.2)
    loss_sum, normaliser = aggregate(result.per_token, inputs["mask"], "token", 8, weights)
    (loss_sum / normaliser).backward()
    reinforce = -(inputs["advantages"].unsqueeze(1) * inputs["mask"]) / inputs["mask"].sum()
    torch.testing.assert_close(logps.grad, reinforce, atol=TOL, rtol=0)
    assert float(result.clipped.sum()) == 0.0


def test_clipping_keeps_the_gradient_only_where_the_ratio_is_inside_its_range():
    logps = torch.zeros(1, 4, requires_grad=True)
    old = torch.tensor([[0.0, -0.5, 0.5, -0.5]])  # ratios 1, e^0.5, e^-0.5, e^0.5
    mask = torch.ones(1, 4)
    result = policy_loss(logps, old, torch.tensor([1.0]), mask, epsilon=0.2)
    result.per_token.sum().backward()
    # positive advantage: a ratio above 1.2 is clipped (no gradient); one below 0.8 is not (min keeps it)
    assert result.clipped.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert logps.grad[0, 1] == 0 and logps.grad[0, 3] == 0 and logps.grad[0, 0] != 0 and logps.grad[0, 2] != 0


@pytest.mark.parametrize("how", ["token", "sequence"])
def test_truncated_importance_weights_scale_each_surrogate_as_the_formula(how):
    """Rollouts from a stale engine: clip against pi_old, each token's surrogate times min(pi_old / pi_b, cap)."""
    inputs = fixed_inputs()
    generator = torch.Generator().manual_seed(3)
    behaviour = inputs["old"] + torch.randn(inputs["old"].shape, generator=generator) * 0.8  # some weights > cap
    weights = torch.ones(len(LENGTHS))
    settings = dict(epsilon=0.2, epsilon_high=0.28, beta=0.04)
    ours_logps = inputs["logps"].clone().requires_grad_()
    is_weights = tis_weights(inputs["old"], behaviour, inputs["mask"], 2.0)
    result = policy_loss(ours_logps, inputs["old"], inputs["advantages"], inputs["mask"], ref_logps=inputs["ref"],
                         is_weights=is_weights, **settings)
    loss_sum, normaliser = aggregate(result.per_token, inputs["mask"], how, 8, weights)
    (loss_sum / normaliser).backward()

    theirs_logps = inputs["logps"].clone().requires_grad_()
    expected = direct_loss(theirs_logps, inputs["old"], inputs["ref"], inputs["mask"], inputs["advantages"], how=how,
                           max_new_tokens=8, weights=weights, behaviour=behaviour, cap=2.0, **settings)
    expected.backward()
    torch.testing.assert_close(loss_sum / normaliser, expected.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, atol=TOL, rtol=0)
    capped = (torch.exp(inputs["old"] - behaviour) > 2.0) & (inputs["mask"] > 0)
    assert capped.any() and (~capped & (inputs["mask"] > 0)).any()  # the cap was active on some tokens, not all


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_of_each_mode_equal_their_definition(mode):
    """TRL's ``vllm_importance_sampling_mode``s, element by element: the ratio pi_old / pi_behaviour of each token
    (``token_*``) or of the whole completion (``sequence_*``, the product of its tokens' ratios), above the cap
    truncated to it or set to 0; 0 outside the completion."""
    inputs = fixed_inputs()
    mask = inputs["mask"]
    behaviour = inputs["old"] + torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * 0.4
    cap = 1.5
    weights = tis_weights(inputs["old"], behaviour, mask, cap, mode)
    level, how = mode.split("_")
    capped = 0
    for i in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        sequence = math.exp(sum(float(inputs["old"][i, t] - behaviour[i, t]) for t in tokens))
        for t in range(mask.shape[1]):
            if t not in tokens:
                assert float(weights[i, t]) == 0.0
                continue
            ratio = sequence if level == "sequence" else math.exp(float(inputs["old"][i, t] - behaviour[i, t]))
            capped += ratio > cap
            expected = min(ratio, cap) if how == "truncate" else (ratio if ratio <= cap else 0.0)
            assert float(weights[i, t]) == pytest.approx(expected, rel=1e-5), (i, t)
    assert 0 < capped < int(mask.sum())  # the cap acted on some tokens, not all


def test_filter_equal_rewards_leaves_tied_groups_out_of_the_gradient_and_the_normaliser():
    """DAPO's dynamic sampling (Yu et al. 2025): a group whose rewards all tie teaches nothing; filtered, it weighs 0
    and its tokens leave the count the loss is divided by (kept, they dilute the other groups' gradient)."""
    from posttune_grpo.rollouts import advantages_of

    rewards = torch.tensor(REWARDS)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(6)] for n in LENGTHS])
    spec = {"group_size": G, "scale_rewards": "group", "baseline": "mean"}
    _, filtered, equal = advantages_of(rewards, torch.ones(8), {**spec, "filter_equal_rewards": True})
    _, kept, _ = advantages_of(rewards, torch.ones(8), {**spec, "filter_equal_rewards": False})
    assert filtered.tolist() == [1.0] * 4 + [0.0] * 4 and kept.tolist() == [1.0] * 8
    assert equal.tolist() == [0.0] * 4 + [1.0] * 4
    per_token = torch.ones(8, 6)
    assert float(aggregate(per_token, mask, "token", 6, filtered)[1]) == sum(LENGTHS[:4])
    assert float(aggregate(per_token, mask, "token", 6, kept)[1]) == sum(LENGTHS)


def test_batch_scaling_without_a_gathered_std_leaves_placeholders_out():
    """A rank padded with a placeholder group (an empty share; the Ray workers score without the learner's
    gathered std): the batch std is that of the real completions only, as TRL's over the generated batch."""
    from posttune_grpo.rollouts import advantages_of

    rewards = torch.tensor(REWARDS[:4] + [0.0] * 4)
    real = torch.tensor([1.0] * 4 + [0.0] * 4)
    spec = {"group_size": G, "scale_rewards": "batch", "baseline": "mean", "filter_equal_rewards": False}
    advantages, weights, _ = advantages_of(rewards, real, spec)
    assert advantages[:4].tolist() == pytest.approx(direct_advantages(REWARDS[:4], "batch"), abs=TOL)
    assert weights.tolist() == real.tolist()


def test_the_logged_kl_is_the_k3_mean_over_the_trained_tokens_only(monkeypatch):
    """A completion left out (weight 0) far from the reference changes neither the loss nor the logged ``kl``:
    the mean of Schulman's k3, ``exp(ref - logp) - (ref - logp) - 1``, over the tokens that train."""
    from types import SimpleNamespace

    import posttune_grpo
    import posttune_grpo.loss as grpo_loss

    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.1, -0.9], [-3.0, -3.0]])
    monkeypatch.setattr(grpo_loss, "learner_logps", lambda session, batch, **_: logps.clone().requires_grad_())
    batch = {"labels": torch.tensor([[5, 6], [7, 8]]), "weights": torch.tensor([1.0, 0.0]),
             "advantages": torch.tensor([1.0, 0.0]), "behaviour_logps": logps, "ref_logps": ref,
             "truncated": torch.zeros(2), "rows": torch.tensor([0, 0]), "rewards": torch.zeros(2),
             "lengths": torch.tensor([2, 2]), "per_reward": {}, "num_tokens": torch.tensor(4)}
    session = SimpleNamespace(method_config=posttune_grpo.GRPOConfig(beta=0.04, max_new_tokens=2))
    total, count = grpo_loss.loss(session, batch).metrics["kl"]
    k3 = torch.exp(ref[0] - logps[0]) - (ref[0] - logps[0]) - 1
    assert float(total / count) == pytest.approx(float(k3.mean()), rel=1e-6)
