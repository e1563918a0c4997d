"""PPO's tensor functions against a direct implementation of each formula, written row by row.

The reference walks each row's list of completion positions with Python floats: per-token KL rewards
with the score at the last token, the textbook GAE recursion (no bootstrap after the last token),
TRL's historical whitening (masked mean, Bessel-corrected masked variance, ``rsqrt(var + 1e-8)``), and
the clipped policy and value losses. The batch has rows with different prompt offsets and lengths, right
padding, a row that fills the whole sequence, a one-token row and a placeholder row with no completion;
padding holds garbage that must reach neither outputs nor gradients.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

try:
    from posttune_ppo.advantages import (gae, masked_mean, masked_whiten, penalised_scores, policy_loss,
                                         token_rewards, value_loss)
except ImportError:  # the package is not installed yet: import it from the source tree
    sys.path.insert(0, str(Path(__file__).parents[2] / "posttune_methods/ppo"))
    from posttune_ppo.advantages import (gae, masked_mean, masked_whiten, penalised_scores, policy_loss,
                                         token_rewards, value_loss)

TOL = 1e-6
S = 20
# (prompt offset, completion length) per row: the completion's targets sit at offset .. offset + length - 1
ROWS = [(2, 9), (0, 20), (6, 5), (4, 0), (11, 9), (7, 1), (1, 14)]
PLACEHOLDER = 3
GARBAGE = 1e3  # what padding holds in the inputs


def positions(row: int) -> list[int]:
    offset, length = ROWS[row]
    return list(range(offset, offset + length))


def make_mask() -> torch.Tensor:
    mask = torch.zeros(len(ROWS), S, dtype=torch.bool)
    for i in range(len(ROWS)):
        mask[i, positions(i)] = True
    return mask


def rand(seed: int, scale: float = 1.0, shift: float = 0.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random ``[N, S]`` values inside the mask, ``GARBAGE`` outside it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(ROWS), S, generator=gen, dtype=torch.float64) * scale + shift
    return torch.where(make_mask(), x, GARBAGE).to(dtype)


def close(actual: torch.Tensor, expected: list[list[float]] | torch.Tensor, tol: float = TOL) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


def full(per_row: dict[tuple[int, int], float]) -> list[list[float]]:
    """A dense ``[N, S]`` list from ``{(row, position): value}``, 0 elsewhere."""
    out = [[0.0] * S for _ in ROWS]
    for (i, t), v in per_row.items():
        out[i][t] = v
    return out


# ---- references -----------------------------------------------------------------------------------------


def ref_whiten(x: torch.Tensor, shift_mean: bool = True) -> list[list[float]]:
    xs = [float(x[i, t]) for i in range(len(ROWS)) for t in positions(i)]
    n = len(xs)
    mean = sum(xs) / n
    var = sum((v - mean) ** 2 for v in xs) / n * (n / (n - 1))
    out = {}
    for i in range(len(ROWS)):
        for t in positions(i):
            w = (float(x[i, t]) - mean) / math.sqrt(var + 1e-8)
            out[i, t] = w if shift_mean else w + mean
    return full(out)


def ref_rewards(scores, logps, ref_logps, kl_coef, estimator):
    rewards, kls = {}, {}
    for i in range(len(ROWS)):
        pos = positions(i)
        for t in pos:
            lp, rf = float(logps[i, t]), float(ref_logps[i, t])
            kl = lp - rf if estimator == "k1" else math.exp(rf - lp) - (rf - lp) - 1
            kls[i, t] = kl
            rewards[i, t] = -kl_coef * kl + (float(scores[i]) if t == pos[-1] else 0.0)
    return full(rewards), full(kls)


def ref_gae(rewards, values, gamma, lam):
    advs, rets = {}, {}
    for i in range(len(ROWS)):
        pos = positions(i)
        last_gae = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_value = float(values[i, pos[k + 1]]) if k + 1 < len(pos) else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            last_gae = delta + gamma * lam * last_gae
            advs[i, t] = last_gae
            rets[i, t] = last_gae + float(values[i, t])
    return full(advs), full(rets)


def ref_policy(logps, old_logps, advantages, cliprange):
    losses, clipped, grads = {}, {}, {}
    for i in range(len(ROWS)):
        for t in positions(i):
            ratio = math.exp(float(logps[i, t]) - float(old_logps[i, t]))
            a = float(advantages[i, t])
            plain = -a * ratio
            capped = -a * min(max(ratio, 1 - cliprange), 1 + cliprange)
            losses[i, t] = max(plain, capped)
            clipped[i, t] = float(capped > plain)
            grads[i, t] = 0.0 if capped > plain else -a * ratio  # d loss / d logp
    return full(losses), full(clipped), full(grads)


def ref_value(values, old_values, returns, cliprange):
    losses, clipped, grads = {}, {}, {}
    for i in range(len(ROWS)):
        for t in positions(i):
            v, old, r = float(values[i, t]), float(old_values[i, t]), float(returns[i, t])
            plain = (v - r) ** 2
            if cliprange is None:
                capped = -math.inf
            else:
                capped = (old + min(max(v - old, -cliprange), cliprange) - r) ** 2
            losses[i, t] = 0.5 * max(plain, capped)
            clipped[i, t] = float(capped > plain)
            grads[i, t] = 0.0 if capped > plain else v - r  # d loss / d v
    return full(losses), full(clipped), full(grads)


# ---- tests ----------------------------------------------------------------------------------------------


def test_masked_mean_per_row_and_overall():
    x, mask = rand(0), make_mask()
    per_row = [sum(float(x[i, t]) for t in positions(i)) / len(positions(i)) if positions(i) else 0.0
               for i in range(len(ROWS))]
    close(masked_mean(x, mask, dim=1), per_row)
    everything = [float(x[i, t]) for i in range(len(ROWS)) for t in positions(i)]
    close(masked_mean(x, mask.float()), sum(everything) / len(everything))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_trl(shift_mean):
    x, mask = rand(1, scale=3.0, shift=2.0), make_mask()
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    close(out, ref_whiten(x, shift_mean))


def test_masked_whiten_moments():
    x, mask = rand(2, scale=3.0, shift=2.0), make_mask()
    xs = x[mask]
    w = masked_whiten(x, mask)[mask]
    assert abs(w.mean().item()) < TOL
    assert abs(w.var(unbiased=True).item() - 1.0) < TOL
    kept = masked_whiten(x, mask, shift_mean=False)[mask]
    assert abs(kept.mean().item() - xs.mean().item()) < TOL
    close(kept - xs.mean(), w)
    assert abs(xs.mean().item()) > 0.5  # the check above could fail
    assert (masked_whiten(x, mask)[~mask] == 0).all()


def test_masked_whiten_fewer_than_two():
    x = rand(3)
    one = torch.zeros(len(ROWS), S, dtype=torch.bool)
    one[2, 7] = True
    out = masked_whiten(x, one)
    assert out[2, 7].item() == x[2, 7].item()
    assert (out[~one] == 0).all()
    none = masked_whiten(x, torch.zeros_like(one))
    assert (none == 0).all() and not none.isnan().any()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_token_rewards(estimator):
    mask = make_mask()
    logps, ref_logps = rand(4, scale=0.5, shift=-2.0), rand(5, scale=0.5, shift=-2.0)
    scores = torch.randn(len(ROWS), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    rewards, kl = token_rewards(scores, logps, ref_logps, mask, kl_coef=0.05, kl_estimator=estimator)
    want_rewards, want_kl = ref_rewards(scores, logps, ref_logps, 0.05, estimator)
    close(rewards, want_rewards)
    close(kl, want_kl)
    assert (rewards[PLACEHOLDER] == 0).all() and (kl[PLACEHOLDER] == 0).all()
    assert (rewards[0] != 0).sum() == len(positions(0))  # nonzero inside the mask: zeros could not pass
    if estimator == "k3":
        assert (kl[mask] >= 0).all()


def test_token_rewards_unknown_estimator():
    mask = make_mask()
    with pytest.raises(ValueError, match="kl_estimator"):
        token_rewards(torch.zeros(len(ROWS)), rand(0), rand(1), mask, 0.1, kl_estimator="k2")


@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (1.0, 0.95), (0.9, 1.0), (1.0, 1.0)])
def test_gae_matches_recursion(gamma, lam):
    mask = make_mask()
    rewards, values = rand(7), rand(8, scale=2.0)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = ref_gae(rewards, values, gamma, lam)
    close(advantages, want_adv)
    close(returns, want_ret)
    assert (advantages[PLACEHOLDER] == 0).all() and (returns[~mask] == 0).all()


def test_gae_float32_inputs():
    mask = make_mask()
    rewards, values = rand(9, dtype=torch.float32), rand(10, scale=2.0, dtype=torch.float32)
    advantages, returns = gae(rewards, values, mask, 0.99, 0.95)
    assert advantages.dtype == torch.float32
    want_adv, want_ret = ref_gae(rewards, values, 0.99, 0.95)
    close(advantages, want_adv, tol=1e-5)
    close(returns, want_ret, tol=1e-5)


def test_gae_single_token_and_full_row():
    """Direct spot checks: a one-token row's advantage is ``r - V``; a row that fills S does not bootstrap."""
    mask = make_mask()
    rewards, values = rand(11), rand(12)
    advantages, _ = gae(rewards, values, mask, 0.99, 0.95)
    t = positions(5)[0]
    assert abs(advantages[5, t].item() - (rewards[5, t] - values[5, t]).item()) < TOL
    assert abs(advantages[1, S - 1].item() - (rewards[1, S - 1] - values[1, S - 1]).item()) < TOL


def test_pipeline_rewards_gae_whiten():
    """Score + KL rewards, GAE, whitened advantages: the full RLHF chain against the references."""
    mask = make_mask()
    logps, ref_logps, values = rand(13, 0.5, -2.0), rand(14, 0.5, -2.0), rand(15)
    scores = torch.tensor([1.5, -0.5, 2.0, 7.0, 0.3, -1.0, 0.8], dtype=torch.float64)
    rewards, _ = token_rewards(scores, logps, ref_logps, mask, kl_coef=0.1)
    advantages, returns = gae(rewards, values, mask, 0.99, 0.95)
    want_rewards, _ = ref_rewards(scores, logps, ref_logps, 0.1, "k1")
    want_adv, want_ret = ref_gae(torch.tensor(want_rewards), values, 0.99, 0.95)
    close(returns, want_ret)
    close(masked_whiten(advantages, mask), ref_whiten(torch.tensor(want_adv)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_policy_loss(dtype):
    mask = make_mask()
    old_logps = rand(16, 0.5, -2.0, dtype)
    logps = (old_logps + rand(17, 0.3, 0.0, dtype)).requires_grad_(True)
    advantages = torch.where(mask, rand(18, dtype=dtype), 0)
    loss, clipped = policy_loss(logps, old_logps, advantages, mask, cliprange=0.2)
    want_loss, want_clipped, want_grad = ref_policy(logps.detach(), old_logps, advantages, 0.2)
    close(loss, want_loss)
    close(clipped, want_clipped)
    n_clipped = int(clipped.sum())
    assert 0 < n_clipped < int(mask.sum())  # both branches are exercised
    loss.sum().backward()
    close(logps.grad, want_grad)
    assert (logps.grad[~mask] == 0).all()
    assert (logps.grad[mask & (clipped == 0)] != 0).any()


@pytest.mark.parametrize("cliprange_value", [0.2, None])
def test_value_loss(cliprange_value):
    mask = make_mask()
    old_values = rand(19, dtype=torch.float32)
    values = (old_values + rand(20, 0.4, 0.0, torch.float32)).requires_grad_(True)
    returns = rand(21, dtype=torch.float32)
    loss, clipped = value_loss(values, old_values, returns, mask, cliprange_value)
    want_loss, want_clipped, want_grad = ref_value(values.detach(), old_values, returns, cliprange_value)
    close(loss, want_loss)
    close(clipped, want_clipped)
    if cliprange_value is None:
        assert (clipped == 0).all()
    else:
        assert 0 < int(clipped.sum()) < int(mask.sum())  # both branches are exercised
    loss.sum().backward()
    close(values.grad, want_grad)
    assert (values.grad[~mask] == 0).all()
    assert (loss[~mask] == 0).all()


def test_no_nan_from_placeholders_or_padding():
    """All rows placeholders, and padding holding NaN/-inf: outputs and gradients are finite zeros there."""
    empty = torch.zeros(3, S, dtype=torch.bool)
    x = torch.full((3, S), float("nan"), dtype=torch.float32)
    logps = torch.full((3, S), float("-inf"), requires_grad=True)
    values = x.clone().requires_grad_(True)
    outs = [masked_mean(x, empty), masked_mean(x, empty, dim=1), masked_whiten(x, empty)]
    outs += token_rewards(torch.ones(3), logps, x, empty, 0.1, "k3")
    outs += gae(x, x, empty, 0.99, 0.95)
    p_loss, p_clipped = policy_loss(logps, x, x, empty, 0.2)
    v_loss, v_clipped = value_loss(values, x, x, empty, 0.2)
    outs += [p_loss, p_clipped, v_loss, v_clipped]
    for out in outs:
        assert (out == 0).all(), out
    (p_loss.sum() + v_loss.sum()).backward()
    assert (logps.grad == 0).all() and (values.grad == 0).all()

    # the same garbage in the padding of a real batch leaves the masked results unchanged
    mask = make_mask()
    rewards, vals = rand(22), rand(23)
    clean_adv, _ = gae(rewards, vals, mask, 0.99, 0.95)
    dirty = torch.where(mask, vals, float("nan"))
    dirty_adv, dirty_ret = gae(torch.where(mask, rewards, float("inf")), dirty, mask, 0.99, 0.95)
    assert torch.equal(dirty_adv, clean_adv) and not dirty_ret.isnan().any()
    assert not masked_whiten(dirty, mask).isnan().any()


@pytest.mark.parametrize("whiten_rewards, whiten_advantages", [(True, False), (False, True), (True, True)])
def test_the_experience_pipeline_whitens_as_trl(whiten_rewards, whiten_advantages):
    """``add_advantages`` (what a PPO step trains on): ``whiten_rewards`` scales the token rewards without moving
    their mean (TRL's ``masked_whiten(rewards, mask, shift_mean=False)``), GAE on them, then ``whiten_advantages``
    centres and scales the advantages; returns are GAE's, before the advantages are whitened."""
    from types import SimpleNamespace

    from posttune_ppo.experience import add_advantages

    mask = make_mask()
    logps, ref_logps, values = rand(13, 0.5, -2.0), rand(14, 0.5, -2.0), rand(15)
    scores = torch.tensor([1.5, -0.5, 2.0, 7.0, 0.3, -1.0, 0.8], dtype=torch.float64)
    batch = {"labels": torch.where(mask, 1, -100), "weights": torch.ones(len(ROWS)), "scores": scores,
             "old_logps": logps, "ref_logps": ref_logps, "values": values}
    config = SimpleNamespace(kl_coef=0.1, kl_estimator="k1", gamma=0.99, lam=0.95, whiten_rewards=whiten_rewards,
                             whiten_advantages=whiten_advantages)
    add_advantages(SimpleNamespace(method_config=config, mesh=None, device=torch.device("cpu"),
                                   plan=SimpleNamespace(mesh={})), batch)
    rewards, _ = ref_rewards(scores, logps, ref_logps, 0.1, "k1")
    if whiten_rewards:
        rewards = ref_whiten(torch.tensor(rewards), shift_mean=False)
    advantages, returns = ref_gae(torch.tensor(rewards), values, 0.99, 0.95)
    close(batch["returns"], returns)
    close(batch["advantages"], ref_whiten(torch.tensor(advantages)) if whiten_advantages else advantages)


@pytest.mark.parametrize("penalty", [None, 1.5])
def test_missing_eos_penalty_lowers_the_score_of_completions_without_their_eos(penalty):
    """TRL's ``PPOTrainer``: ``scores[~contain_eos_token] -= missing_eos_penalty``, only for a completion cut off
    before its EOS (``truncated``), which the rollouts mark as those without an EOS."""
    eos = 2
    completions = [[5, 6, eos], [7, 8, 9], [eos], [4, 4, 4]]
    rewards = torch.tensor([1.0, 0.5, -0.25, 2.0])
    contain_eos = torch.tensor([eos in ids for ids in completions])
    expected = rewards.clone()
    if penalty is not None:
        expected[~contain_eos] -= penalty
    torch.testing.assert_close(penalised_scores(rewards, (~contain_eos).float(), penalty), expected)
