"""KTO's loss (posttune_dpo.kto_losses) against the paper's formula and against TRL's KTOTrainer, gradients included.

The paper (Ethayarajh et al. 2024, eq. 7) with ``r`` an example's summed log-ratio and ``z0`` the
clamped, detached KL estimate: a desirable example's loss is ``lambda_D (1 - sigmoid(beta (r - z0)))``,
an undesirable one's ``lambda_U (1 - sigmoid(beta (z0 - r)))``. TRL 1.x has no stand-alone KTO loss
function any more: ``KTOTrainer._compute_loss`` computes it from the models' per-token log-probs, so
it runs here on stand-in models that hand it chosen per-example log-probs (one position per row holds
the row's sum), and posttune's per-example losses, summed and divided by the examples as the trainer
does, must give its loss, its gradient, its ``kl`` and its rewards.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from posttune_dpo.kto_losses import kl_reference_point, kto_losses

BETA = 0.3


def examples(seed: int = 0, n: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = {name: -20 * torch.rand(n, generator=generator, dtype=torch.float64)
              for name in ("policy", "reference", "policy_kl", "reference_kl")}
    values["policy"] = values["reference"] + 4 * torch.randn(n, generator=generator, dtype=torch.float64)
    values["policy_kl"] = values["reference_kl"] + 2 + torch.randn(n, generator=generator, dtype=torch.float64)
    values["desirable"] = torch.tensor([True, False, True, True, False, False][:n])
    return values


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33), (0.7, 2.0)])
def test_kto_losses_follow_the_paper_formula_with_gradients(weights):
    desirable_weight, undesirable_weight = weights
    ex = examples()
    policy = ex["policy"].clone().requires_grad_(True)
    z0 = kl_reference_point((ex["policy_kl"] - ex["reference_kl"]).sum(), torch.tensor(6.0))
    losses, rewards = kto_losses(policy, ex["reference"], ex["desirable"], z0, beta=BETA,
                                 desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    losses.sum().backward()
    kl = float((ex["policy_kl"] - ex["reference_kl"]).mean())
    assert float(z0) == pytest.approx(max(kl, 0.0), abs=1e-12)
    for i in range(6):
        r = float(ex["policy"][i] - ex["reference"][i])
        sign, weight = (1.0, desirable_weight) if ex["desirable"][i] else (-1.0, undesirable_weight)
        s = 1.0 / (1.0 + math.exp(-BETA * sign * (r - max(kl, 0.0))))
        assert losses[i].detach().item() == pytest.approx(weight * (1.0 - s), abs=1e-12)
        # d/dr of w (1 - sigmoid(beta sign (r - z0))) = -w beta sign s (1 - s); nothing flows through z0
        assert float(policy.grad[i]) == pytest.approx(-weight * BETA * sign * s * (1.0 - s), abs=1e-12)
        assert float(rewards[i]) == pytest.approx(BETA * r, abs=1e-12)
    assert not rewards.requires_grad


def test_the_reference_point_is_clamped_at_zero_and_detached():
    ratios = torch.tensor([-3.0, 1.0], requires_grad=True)
    assert float(kl_reference_point(ratios.sum(), torch.tensor(2.0))) == 0.0  # a negative estimate: noise
    z0 = kl_reference_point((ratios + 5).sum(), torch.tensor(2.0))
    assert float(z0) == pytest.approx(4.0) and not z0.requires_grad
    assert float(kl_reference_point(torch.tensor(0.0), torch.tensor(0.0))) == 0.0  # no pairs: 0, not NaN


class _Outputs(SimpleNamespace):
    pass


class _StandIn(torch.nn.Module):
    """A model for TRL's KTOTrainer that answers each sequence with the given per-example log-probability:
    its per-token log-probs are 0 but for the last position, which holds the example's sum. The main
    sequences and the KL ones differ in width, which tells them apart."""

    def __init__(self, main: torch.Tensor, kl: torch.Tensor, main_width: int):
        super().__init__()
        self.main, self.kl, self.main_width = main, kl, main_width
        self.is_gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, **_: object) -> _Outputs:
        values = self.main if input_ids.shape[1] == self.main_width else self.kl
        rows, width = input_ids.shape
        log_probs = torch.cat([torch.zeros(rows, width - 2, dtype=values.dtype), values.unsqueeze(1)], dim=1)
        zeros = torch.zeros(rows, width - 1, dtype=values.dtype)
        return _Outputs(log_probs=log_probs, entropy=zeros, mean_logits=zeros)


def trl_kto(ex: dict[str, torch.Tensor], policy: torch.Tensor, *, desirable_weight: float,
            undesirable_weight: float) -> tuple[torch.Tensor, dict]:
    """TRL's KTO loss (``KTOTrainer._compute_loss``, loss_type ``kto``) of these log-probs, and its metrics."""
    from trl import KTOTrainer

    n, width = len(policy), 5
    batch = {
        "input_ids": torch.ones(n, width, dtype=torch.long), "attention_mask": torch.ones(n, width, dtype=torch.long),
        "completion_mask": torch.ones(n, width, dtype=torch.long),
        "KL_input_ids": torch.ones(n, width + 1, dtype=torch.long),
        "KL_attention_mask": torch.ones(n, width + 1, dtype=torch.long),
        "KL_completion_mask": torch.ones(n, width + 1, dtype=torch.long),
        "label": ex["desirable"].clone(),
    }
    model = _StandIn(policy, ex["policy_kl"], width)
    trainer = SimpleNamespace(
        model=model, ref_model=_StandIn(ex["reference"], ex["reference_kl"], width),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda value: value),
        calculate_KL=True, precompute_ref_logps=False, aux_loss_enabled=False, loss_type="kto", beta=BETA,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight, _tp_size=1,
        _total_train_tokens=0, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    trainer._compute_kl_logps = partial(KTOTrainer._compute_kl_logps, trainer)
    loss = KTOTrainer._compute_loss(trainer, model, batch, False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.7, 2.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kto_loss_matches_trl_with_gradients(weights, seed):
    pytest.importorskip("trl")
    desirable_weight, undesirable_weight = weights
    ex = examples(seed)
    if seed == 1:  # the mismatched pairs' log-ratios below 0 on average: both clamp z0 to 0
        ex["policy_kl"] = ex["reference_kl"] - 3.0
    theirs = ex["policy"].clone().requires_grad_(True)
    trl_loss, logged = trl_kto(ex, theirs, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    trl_loss.backward()

    ours = ex["policy"].clone().requires_grad_(True)
    z0 = kl_reference_point((ex["policy_kl"] - ex["reference_kl"]).sum(), torch.tensor(float(len(ours))))
    losses, rewards = kto_losses(ours, ex["reference"], ex["desirable"], z0, beta=BETA,
                                 desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    loss = losses.sum() / len(ours)  # what the trainer makes of the sum and its normaliser, the examples
    loss.backward()
    torch.testing.assert_close(loss, trl_loss.to(loss.dtype), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-6)
    assert float(z0) == pytest.approx(logged["kl"], abs=1e-6)
    if seed == 1:
        assert logged["kl"] == 0.0
    desirable = ex["desirable"]
    assert float(rewards[desirable].mean()) == pytest.approx(logged["rewards/chosen"], abs=1e-6)
    assert float(rewards[~desirable].mean()) == pytest.approx(logged["rewards/rejected"], abs=1e-6)
