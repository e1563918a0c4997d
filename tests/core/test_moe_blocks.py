"""posttune.modules' mixture-of-experts blocks: grouped GEMM equals the loop over experts, routing
is dropless, and the load-balancing loss is the Switch Transformer formula transformers uses.

Model-level parity with transformers is in tests/models/test_qwen_moe.py and test_mixtral.py.
"""

from __future__ import annotations

import pytest
import torch

from posttune.modules import Experts, MoE, Router, expert_linear
from posttune.modules.moe import pop_aux_loss, sort_by_expert

HIDDEN, INTERMEDIATE, EXPERTS = 16, 24, 4


def _experts(grouped: bool, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    return Experts(EXPERTS, HIDDEN, INTERMEDIATE, grouped=grouped)


def _routing(tokens: int, pattern: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, 2], experts [tokens, 2]): random; expert 3 starved; or every token on expert 1."""
    g = torch.Generator().manual_seed(1)
    if pattern == "random":
        experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(tokens)])
    elif pattern == "one_starved":
        experts = torch.stack([torch.randperm(EXPERTS - 1, generator=g)[:2] for _ in range(tokens)])
    else:  # "all_on_one": expert 1 gets every token, as first choice; the second choice varies
        experts = torch.stack([torch.ones(tokens, dtype=torch.long), torch.randint(2, 4, (tokens,), generator=g)], 1)
    return torch.rand(tokens, 2, generator=g), experts


def _run(experts: Experts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = experts(x, weights, chosen)
    out.square().sum().backward()
    return out.detach(), x.grad, weights.grad, [p.grad.clone() for p in experts.parameters()]


@pytest.mark.parametrize("pattern", ["random", "one_starved", "all_on_one"])
def test_grouped_gemm_equals_the_loop_forward_and_backward(pattern):
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, chosen = _routing(11, pattern)
    grouped, looped = _run(_experts(True), x, weights, chosen), _run(_experts(False), x, weights, chosen)
    for a, b in zip(grouped[:3], looped[:3]):
        assert (a - b).abs().max().item() <= 1e-6
    for a, b in zip(grouped[3], looped[3]):
        assert (a - b).abs().max().item() <= 1e-6
    if pattern == "one_starved":  # an expert without tokens gets a zero gradient, not garbage
        assert all(g[EXPERTS - 1].abs().max().item() == 0 for g in grouped[3])


def test_the_loop_is_each_tokens_experts_weighted_and_summed():
    experts = _experts(False)
    x = torch.randn(5, HIDDEN)
    weights, chosen = _routing(5, "random")
    expected = torch.zeros_like(x)
    for t in range(5):
        for slot in range(2):
            e = chosen[t, slot]
            h = torch.nn.functional.silu(x[t] @ experts.gate_proj[e].T) * (x[t] @ experts.up_proj[e].T)
            expected[t] += weights[t, slot] * (h @ experts.down_proj[e].T)
    assert (experts(x, weights, chosen) - expected).abs().max().item() <= 1e-5


def test_expert_linear_groups_rows_by_count_including_empty_groups():
    x, w = torch.randn(7, HIDDEN), torch.randn(EXPERTS, 3, HIDDEN)
    counts = torch.tensor([2, 0, 5, 0])
    expected = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T])
    for grouped in (True, False):
        assert (expert_linear(x, w, counts, grouped=grouped) - expected).abs().max().item() <= 1e-6


def test_sort_by_expert_is_stable_and_counts_every_slot():
    chosen = torch.tensor([[2, 0], [0, 1], [2, 3]])
    order, counts = sort_by_expert(chosen, 5)
    assert order.tolist() == [1, 2, 3, 0, 4, 5]  # slots of expert 0, 1, 2 (in token order), 3
    assert counts.tolist() == [2, 1, 2, 1, 0]


@pytest.mark.parametrize("normalize", [True, False])
def test_router_picks_the_top_k_probabilities(normalize):
    torch.manual_seed(0)
    router = Router(HIDDEN, EXPERTS, 2, normalize=normalize)
    x = torch.randn(6, HIDDEN)
    logits, probs, weights, chosen = router(x)
    reference = torch.softmax(x @ router.weight.T, dim=-1)
    top, index = reference.topk(2, dim=-1)
    assert torch.equal(chosen, index)
    expected = top / top.sum(-1, keepdim=True) if normalize else top
    assert (weights - expected).abs().max().item() <= 1e-6
    assert (probs - reference).abs().max().item() <= 1e-6


def _moe(aux: float = 0.01, z: float = 0.0) -> MoE:
    torch.manual_seed(0)
    return MoE(Router(HIDDEN, EXPERTS, 2, normalize=True), Experts(EXPERTS, HIDDEN, INTERMEDIATE),
               aux_loss_coef=aux, z_loss_coef=z)


def switch_balance(probs_per_layer: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch Transformer eqs. 4-6 as transformers applies them to every layer's tokens concatenated."""
    probs = torch.cat(probs_per_layer)
    chosen = probs.topk(top_k, dim=-1).indices
    share = torch.nn.functional.one_hot(chosen, probs.shape[-1]).float().mean(dim=0)  # [top_k, experts]
    return probs.shape[-1] * torch.sum(share * probs.mean(dim=0))


def test_aux_loss_is_the_switch_formula_over_all_layers_and_forwards():
    layers = [_moe(), _moe()]
    xs = [torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    probs = []
    for x in xs:  # two forwards before the loss (DPO's chosen and rejected) and two layers
        for layer in layers:
            layer(x)
            probs.append(torch.softmax(x.reshape(-1, HIDDEN) @ layer.router.weight.T, dim=-1))
    loss, metrics = pop_aux_loss(layers)
    expected = switch_balance(probs, 2)
    assert abs(metrics["aux_loss"].item() - expected.item()) <= 1e-6
    assert abs(loss.item() - 0.01 * expected.item()) <= 1e-8
    assert metrics["expert_tokens_mean"].item() == pytest.approx(3 * 10 * 2 / EXPERTS)
    assert pop_aux_loss(layers) is None  # taken once


def test_aux_loss_gradient_reaches_the_router():
    layer = _moe()
    layer(torch.randn(3, 4, HIDDEN))
    loss, _ = pop_aux_loss([layer])
    loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_forwards_without_gradients_record_nothing():
    layer = _moe()
    with torch.no_grad():
        layer(torch.randn(3, 4, HIDDEN))
    assert pop_aux_loss([layer]) is None


def test_router_z_loss_is_the_mean_squared_logsumexp():
    layer = _moe(aux=0.0, z=0.5)
    x = torch.randn(3, 4, HIDDEN)
    layer(x)
    loss, metrics = pop_aux_loss([layer])
    logits = x.reshape(-1, HIDDEN) @ layer.router.weight.T
    expected = torch.logsumexp(logits, dim=-1).square().mean()
    assert abs(metrics["router_z_loss"].item() - expected.item()) <= 1e-6
    assert abs(loss.item() - 0.5 * expected.item()) <= 1e-6


def test_shared_expert_is_gated_by_a_sigmoid():
    from torch import nn

    from posttune.modules import GatedMLP

    torch.manual_seed(0)
    shared, gate = GatedMLP(HIDDEN, 8), nn.Linear(HIDDEN, 1, bias=False)
    layer = MoE(Router(HIDDEN, EXPERTS, 2, normalize=False), Experts(EXPERTS, HIDDEN, INTERMEDIATE),
                shared_expert=shared, shared_gate=gate)
    x = torch.randn(2, 3, HIDDEN)
    flat = x.reshape(-1, HIDDEN)
    _, _, weights, chosen = layer.router(flat)
    expected = layer.experts(flat, weights, chosen) + torch.sigmoid(gate(flat)) * shared(flat)
    with torch.no_grad():
        assert (layer(x) - expected.reshape(x.shape)).abs().max().item() <= 1e-6


def test_grouped_gemm_takes_a_broadcast_gradient():
    """``.sum().backward()`` hands grouped GEMM an expanded gradient, which torch 2.13 refuses as is."""
    from posttune.modules.moe import grouped_mm_applies

    x = torch.randn(7, HIDDEN, requires_grad=True)
    w = torch.randn(EXPERTS, 4, HIDDEN, requires_grad=True)
    counts = torch.tensor([2, 0, 5, 0])
    assert grouped_mm_applies(x, w) and not grouped_mm_applies(x, w[:, :3])  # rows of 16 bytes
    expert_linear(x, w, counts, grouped=True).sum().backward()
    loop_x, loop_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expert_linear(loop_x, loop_w, counts, grouped=False).sum().backward()
    assert (x.grad - loop_x.grad).abs().max().item() <= 1e-6 and (w.grad - loop_w.grad).abs().max().item() <= 1e-6
