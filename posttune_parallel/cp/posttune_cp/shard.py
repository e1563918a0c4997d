"""Split each micro-batch over the ``cp`` ranks and route attention through flex attention.

    install(session)        hooks on the model (positions) and on every attention block (mask),
                            and a step context that shards each micro-batch in place
    head_tail_order(S, cp)  global positions held by each rank, [cp, S / cp]

The decoder keeps computing its own (local) mask and positions; the hooks replace them with the
global positions of this rank's tokens and a ``FlexMask`` built from those, so the model code
needs no change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from posttune.modules import Attention, FlexMask, block_mask, default_positions
from posttune.plugin import ModelTarget, PosttuneError, Session, padded_sequence

MASK_ARG = 3  # Attention.forward(x, cos, sin, mask, cache)


def head_tail_order(seq_len: int, cp: int) -> torch.Tensor:
    """[cp, seq_len / cp]: rank r holds chunks r and 2*cp-1-r of the sequence cut in 2*cp."""
    chunks = torch.arange(seq_len).chunk(2 * cp)
    return torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


class ContextParallel:
    """What the hooks read: this micro-batch's local positions and flex mask (None outside a step)."""

    def __init__(self, mesh: Any, multiple: int):
        self.mesh, self.multiple = mesh, multiple
        self.positions: torch.Tensor | None = None
        self.mask: FlexMask | None = None

    @contextlib.contextmanager
    def step(self, _session: Any, batch: dict[str, torch.Tensor]) -> Iterator[None]:
        self.shard(batch)
        try:
            yield
        finally:
            self.positions = self.mask = None

    def shard(self, batch: dict[str, torch.Tensor]) -> None:
        """Pad, then keep this rank's load-balanced share of every [batch, seq] tensor, in place."""
        with padded_sequence(batch, self.multiple):
            pass
        ids = batch["input_ids"]
        size, seq_len = ids.shape
        documents = batch.get("document_ids")
        positions = batch.get("positions")
        if positions is None:
            positions = default_positions(size, seq_len, document_ids=documents, device=ids.device)
        elif documents is not None:
            refuse_shared_prefixes(documents, positions)
        order = head_tail_order(seq_len, self.mesh.size()).to(ids.device)
        mine = order[self.mesh.get_local_rank()]
        for key, value in list(batch.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == seq_len:
                batch[key] = value[:, mine]
        self.positions = positions[:, mine]
        self.mask = FlexMask(causal_mask(mine, order.flatten(), documents, size), self.gather_kv)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every rank, in rank order (autograd: gradients flow back to their rank)."""
        from torch.distributed.nn.functional import all_gather

        group = self.mesh.get_group()
        return torch.cat(all_gather(k.contiguous(), group), dim=2), torch.cat(all_gather(v.contiguous(), group), dim=2)


def refuse_shared_prefixes(documents: torch.Tensor, positions: torch.Tensor) -> None:
    """The flex mask keeps each document to itself: a document that continues another's prefix
    (its positions start above 0, ``posttune.modules.attention``) would silently lose that prefix."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    if bool((positions[starts] != 0).any()):
        raise PosttuneError("context parallelism: a document of this batch continues a shared prefix (its "
                            "positions start above 0), which the cp plan cannot attend to; batch without it")


def causal_mask(local: torch.Tensor, gathered: torch.Tensor, documents: torch.Tensor | None, size: int) -> Any:
    """Local query i (global position local[i]) may see gathered key j (global gathered[j]) when
    it is not later and, for packed rows, in the same document."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q, kv = local[q_idx], gathered[kv_idx]
        allowed = kv <= q
        if documents is not None:
            allowed = allowed & (documents[b, q] == documents[b, kv])
        return allowed

    return block_mask(mask_mod, batch=size if documents is not None else None, q_len=local.numel(),
                      kv_len=gathered.numel(), device=local.device)


def install(session: Session, target: ModelTarget) -> None:
    mesh = session.mesh["cp"]
    tp = session.mesh["tp"].size() if "tp" in (session.mesh.mesh_dim_names or ()) else 1
    state = ContextParallel(mesh, multiple=2 * mesh.size() * tp)
    attach(target.model, state)
    session.step_contexts.append(state.step)


def attach(model: nn.Module, state: ContextParallel) -> None:
    """Positions into the model's forward, the flex mask into every attention block (during a step).

    The flex mask holds the documents, so the forward gets no ``document_ids``: the decoder would
    otherwise find documents in this rank's shard (head and tail chunks, not one run of the row)
    and read the global positions as prefixes to continue."""

    def positions(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if state.positions is not None:
            kwargs = {**kwargs, "positions": state.positions, "document_ids": None}
        return args, kwargs

    def mask(_module: nn.Module, args: tuple) -> tuple:
        if state.mask is None:
            return args
        return (*args[:MASK_ARG], state.mask, *args[MASK_ARG + 1:])

    model.register_forward_pre_hook(positions, with_kwargs=True)
    for module in model.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(mask)
