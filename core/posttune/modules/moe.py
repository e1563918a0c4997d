"""Mixture-of-experts feed-forward: a top-k router, stacked experts run with grouped GEMM, optional
shared experts, and the load-balancing loss exactly as transformers computes it.

    moe = MoE(Router(hidden, num_experts=8, top_k=2, normalize=True), Experts(8, hidden, 64),
              aux_loss_coef=0.001)
    y = moe(x)  # [batch, seq, hidden]; dropless: every token reaches each of its top_k experts

The experts are three stacked parameters laid out as ``nn.Linear`` weights, one slab per expert
(``gate_proj``/``up_proj`` ``[experts, intermediate, hidden]``, ``down_proj`` ``[experts,
hidden, intermediate]``), so per-expert Hugging Face tensors stack into them unchanged. Token
slots are sorted by expert; each expert's contiguous group multiplies its slab in one
``torch._grouped_mm`` call, or in a loop over experts where grouped GEMM does not apply (the
loop is also the reference the tests hold it to). An expert-parallel plan sets ``Experts.dispatch``
to send each token to the rank that holds its expert and back; ``Experts.compute`` runs whichever
experts a rank holds.

Routing statistics feed the auxiliary loss. They are recorded only by forwards that build a
graph (``torch.is_grad_enabled()``), so a frozen model or a generation adds nothing, and
``Decoder.aux_loss`` takes them (docs/architecture.md, "Auxiliary losses"). ``MoE.counted`` (flat
bool, set by ``Decoder.counting``) leaves padding out of them, as transformers' ``attention_mask``
does: padding a plan adds to split the sequence, or a rank's placeholder, would otherwise change the
loss one process computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from posttune.modules.mlp import GatedMLP, gated_product, get_activation


class Router(nn.Module):
    """``softmax(x W^T)`` over the experts (in fp32), its top ``k``; ``normalize``: the k weights sum to 1.

    Returns (logits [n, experts], probabilities [n, experts] fp32, weights [n, k] in x's dtype,
    expert indices [n, k]).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, normalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the {num_experts} experts, got {top_k}")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.weight = nn.Parameter(nn.init.normal_(torch.empty(num_experts, hidden_size), std=0.02))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(logits.dtype), experts

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, normalize={self.normalize}"


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``x @ weight[e]^T``: on CPU in fp32/bf16/fp16, on CUDA in
    bf16 (torch 2.13), and on both only with rows of 16-byte multiples (its backward needs them);
    otherwise the loop runs."""
    if not hasattr(torch, "_grouped_mm") or weight.dtype != x.dtype:
        return False
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if x.device.type == "cpu" else (torch.bfloat16,)
    aligned = all(size * x.element_size() % 16 == 0 for size in weight.shape[1:])
    return x.dtype in dtypes and aligned


def expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, grouped: bool = True) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times each expert's ``weight[e]^T`` (``weight``: [experts, out, in]).

    ``counts[e]`` rows belong to expert e, in order. Grouped GEMM takes the groups' end offsets;
    the loop (``grouped=False``, or where grouped GEMM does not apply) is the reference.
    """
    if grouped and grouped_mm_applies(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    pieces = torch.split(x, counts.tolist())
    # unbind, not weight[e]: each index's backward would add a zero gradient the size of the whole stack
    slabs = weight.unbind(0)
    return (torch.cat([piece @ slab.T for piece, slab in zip(pieces, slabs)]) if pieces
            else x.new_zeros(0, weight.shape[1]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity; hands grouped GEMM's backward a contiguous gradient (it refuses a broadcast one, such
    as ``.sum()``'s, with "Invalid strides/sizes" in torch 2.13)."""

    @staticmethod
    def forward(ctx: object, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Experts(nn.Module):
    """``num_experts`` gated MLPs (``down(act(gate(x)) * up(x))``) stored stacked.

    ``forward(x [n, hidden], weights [n, k], experts [n, k]) -> [n, hidden]``: each token's
    experts' outputs, weighted and summed. ``grouped=False`` runs the loop over experts instead.
    ``dispatch(module, rows sorted by expert, counts per expert) -> their outputs``, when a plan
    sets it, replaces ``compute`` (expert parallelism: the rows travel to their experts' ranks).
    ``unpack(weight) -> [experts, out, in]``, when a technique stores the frozen stacks another way
    (a 4-bit format), gives each in the compute dtype, once per forward.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 grouped: bool = True):
        super().__init__()
        self.num_experts, self.activation, self.grouped = num_experts, activation, grouped
        self.dispatch: Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.unpack: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.act = get_activation(activation)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, std=0.02)  # a run's random init redraws them, seeded (compose.random_init)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        order, counts = sort_by_expert(experts, self.num_experts)
        tokens = order // experts.shape[-1]
        run = self.compute if self.dispatch is None else partial(self.dispatch, self)
        out = run(x[tokens], counts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def compute(self, x: torch.Tensor, counts: torch.Tensor,
                weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The experts on rows already grouped by expert (``counts[e]`` rows each, in order);
        ``weights``: the (gate, up, down) slabs to use instead of this module's (a rank's own experts)."""
        gate_w, up_w, down_w = weights or (self.gate_proj, self.up_proj, self.down_proj)
        if self.unpack is not None:
            gate_w, up_w, down_w = (self.unpack(w) for w in (gate_w, up_w, down_w))
        gate = expert_linear(x, gate_w, counts, grouped=self.grouped)
        up = expert_linear(x, up_w, counts, grouped=self.grouped)
        return expert_linear(gated_product(gate, up, self.activation), down_w, counts, grouped=self.grouped)

    @property
    def intermediate_size(self) -> int:
        return self.down_proj.shape[-1]

    def extra_repr(self) -> str:
        hidden = self.gate_proj.shape[-1]
        return (f"experts={self.num_experts}, hidden={hidden}, intermediate={self.intermediate_size}, "
                f"activation={self.activation}")


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the flat token-slot indices sorted by expert, stable; the slot count per expert)."""
    flat = experts.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


@dataclass
class Routing:
    """What one MoE layer's recorded forwards add up to, for the auxiliary losses."""

    counts: torch.Tensor  # [experts] fp32: token slots routed to each expert (no gradient)
    probs: torch.Tensor  # [experts] fp32: router probabilities summed over tokens (with gradient)
    rows: torch.Tensor  # [] fp32: tokens routed
    z_sum: torch.Tensor | None  # sum over tokens of logsumexp(logits)^2, when a z-loss is asked for


class MoE(nn.Module):
    """Router + experts (+ a shared expert, optionally gated by ``sigmoid(shared_gate(x))``, as some families do).

    ``aux_loss_coef`` weighs the load-balancing loss, ``z_loss_coef`` the router z-loss
    (``mean(logsumexp(logits)^2)``, ST-MoE); both are applied by ``Decoder.aux_loss``.
    """

    def __init__(self, router: Router, experts: Experts, *, shared_expert: GatedMLP | None = None,
                 shared_gate: nn.Linear | None = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0):
        super().__init__()
        if aux_loss_coef < 0 or z_loss_coef < 0:  # a negative weight would reward imbalance
            raise ValueError(f"aux_loss_coef and z_loss_coef must be >= 0, got {aux_loss_coef} and {z_loss_coef}")
        self.router, self.experts = router, experts
        self.shared_expert, self.shared_gate = shared_expert, shared_gate
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.routing: Routing | None = None
        self.counted: torch.Tensor | None = None  # [tokens] bool: the real ones (None: all)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, probs, weights, experts = self.router(flat)
        if torch.is_grad_enabled():
            counted = self.counted if self.counted is not None and self.counted.numel() == flat.shape[0] else None
            self.record(logits, probs, experts, counted)
        out = self.experts(flat, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.reshape(x.shape)

    def record(self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor,
               counted: torch.Tensor | None = None) -> None:
        """Add this forward's statistics; ``counted`` (bool [tokens]): only those tokens' (weights, not
        indexing: no data-dependent shapes for a compiled layer)."""
        weight = (torch.ones(probs.shape[0], device=probs.device) if counted is None
                  else counted.to(device=probs.device, dtype=torch.float32))
        slots = weight.repeat_interleave(experts.shape[-1])
        counts = torch.bincount(experts.reshape(-1), weights=slots, minlength=self.router.num_experts).float()
        z_sum = (torch.logsumexp(logits.float(), dim=-1).square() * weight).sum() if self.z_loss_coef else None
        step = Routing(counts, (probs * weight[:, None]).sum(dim=0), weight.sum(), z_sum)
        if self.routing is not None:  # several forwards before one loss
            old = self.routing
            z = None if z_sum is None else z_sum + old.z_sum
            step = Routing(old.counts + step.counts, old.probs + step.probs, old.rows + step.rows, z)
        self.routing = step

    @property
    def intermediate_per_token(self) -> int:
        """The intermediate width one token goes through (top-k experts and the shared one): the
        activation estimate's MLP width."""
        shared = self.shared_expert.down_proj.in_features if self.shared_expert is not None else 0
        return self.router.top_k * self.experts.intermediate_size + shared


def pop_aux_loss(layers: list[MoE], reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """The weighted auxiliary loss of the forwards ``layers`` recorded since the last call, and its
    parts (unweighted) as metrics; the records are cleared. None when nothing was recorded.

    ``reduce`` sums a tensor over the data-parallel ranks, gradients included (the trainer passes
    one): the statistics are then those of the global batch, so every rank computes the loss one
    process computes over all the tokens, and its gradient reaches every rank's router.

    The load-balancing loss is transformers' ``load_balancing_loss_func`` (Switch Transformer,
    eqs. 4-6, over every layer's tokens at once): ``experts * sum_e f_e * P_e`` with ``f_e`` the
    share of top-k slots routed to expert e and ``P_e`` its mean router probability, both taken
    over all layers' tokens together; it is ``top_k`` when the load is uniform.
    """
    records = [(layer, layer.routing) for layer in layers if layer.routing is not None]
    for layer in layers:
        layer.routing = None
    if not records:
        return None
    first = records[0][0]
    experts = first.router.num_experts
    counts = torch.stack([r.counts for _, r in records])  # [layers, experts]
    probs = torch.stack([r.probs for _, r in records]).sum(dim=0)
    z_sum = sum(r.z_sum for _, r in records) if first.z_loss_coef else None
    rows = torch.stack([r.rows for _, r in records]).sum()
    if reduce is not None:
        counts, probs, rows = reduce(counts), reduce(probs), reduce(rows)
        z_sum = reduce(z_sum) if z_sum is not None else None
    balance = experts * torch.sum((counts.sum(dim=0) / rows) * (probs / rows))
    loss = first.aux_loss_coef * balance
    # token slots per (layer, expert): a starved expert shows as a min of 0 (dropless: no token is dropped)
    metrics = {"aux_loss": balance.detach(), "expert_tokens_min": counts.min(), "expert_tokens_mean": counts.mean(),
               "expert_tokens_max": counts.max()}
    if z_sum is not None:
        z_loss = z_sum / rows
        loss = loss + first.z_loss_coef * z_loss
        metrics["router_z_loss"] = z_loss.detach()
    return loss, metrics
