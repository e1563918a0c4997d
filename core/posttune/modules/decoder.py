"""The pre-norm decoder: embedding -> layers (attention + MLP, each with a residual) -> norm -> head.

The native model contract every family returns from ``build``::

    logits = model(input_ids, positions=None, document_ids=None, kv_cache=None, padding_mask=None)  # [b, s, vocab]
    hidden = model.hidden_states(input_ids, ...)  # final-normed [b, s, hidden]
    logits = model.logits(hidden)  # == model.output(hidden) unless the model soft-caps logits

Positions default to 0..s-1 (continuing from a KV cache's length); with ``document_ids`` they
restart at 0 for each document of a packed row, and attention stays within each document;
given explicitly with ``document_ids``, a document starting at ``p > 0`` continues the first ``p``
tokens of the document it shares them with (a shared prompt: ``modules/attention.py``).
``padding_mask`` [b, kv_len] (True = a real token, over the cached tokens and these) serves
left-padded batches in generation: no token attends to padding, and a row's positions count
its real tokens only (the first real token is position 0, as transformers does from
``attention_mask.cumsum(-1) - 1``), so each row's logits are those of the row alone.

Options a family switches on (each off by default, so a plain pre-norm decoder pays nothing):

- ``embed_scale``: the embedding output is multiplied by this constant, rounded to fp32 and then
  to the embedding's dtype first (``sqrt(3072)`` becomes 55.5 in bf16; the checkpoints were
  trained with the rounded value, and transformers rounds the same way).
- ``local_rope``: layers whose attention has a sliding window take their cos/sin from this
  RoPE instead of ``rope`` (local/global attention with two RoPE bases); full-attention
  layers keep ``rope``.
- ``logit_softcap``: ``forward`` returns ``cap * tanh(logits / cap)``. ``hidden_states`` is
  unchanged, so the contract becomes ``logits = model.logits(hidden)``: code that forms logits
  from hidden states itself (a chunked cross-entropy that never materialises the full logits)
  must call ``model.logits(hidden_chunk)``, or apply
  ``soft_cap(model.output(hidden_chunk), model.logit_softcap)`` per chunk; calling
  ``model.output`` alone is only right when ``model.logit_softcap`` is None.
- ``DecoderLayer`` post-norms: ``attn_post_norm`` / ``mlp_post_norm`` normalise a block's output
  before it joins the residual ("sandwich" norms); identities by default.

Auxiliary losses: ``model.aux_loss()`` returns the weighted auxiliary loss of the forwards run
with gradients since its last call (a mixture of experts' load balancing, ``modules/moe.py``) and
its parts as metrics, or None (a dense model). The trainer adds it to every method's loss, and
runs each micro-batch's loss within ``model.counting(batch["input_ids"], batch["real_tokens"])``,
so that padding stays out of the routing statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from posttune.modules.attention import Attention, DocumentSpans, attention_mask, document_spans
from posttune.modules.kv_cache import KVCache, LayerCache
from posttune.modules.moe import MoE, pop_aux_loss
from posttune.modules.rope import RotaryEmbedding
from posttune.modules.softcap import soft_cap


def forward_takes(model: Any, argument: str) -> bool:
    """Whether ``model``'s forward takes ``argument``: the native decoder's options (``logits_to_keep``,
    ``logits_at``); another family's model may not have them, and then gets the plain call."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return argument in parameters


class DecoderLayer(nn.Module):
    """``x + attn_post_norm(attn(attn_norm(x)))`` then ``x + mlp_post_norm(mlp(mlp_norm(x)))``.

    The post-norms are identities unless given (plain pre-norm, as Llama).
    """

    def __init__(self, attn: Attention, mlp: nn.Module, attn_norm: nn.Module, mlp_norm: nn.Module, *,
                 attn_post_norm: nn.Module | None = None, mlp_post_norm: nn.Module | None = None):
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.attn_post_norm = attn_post_norm if attn_post_norm is not None else nn.Identity()
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.mlp_post_norm = mlp_post_norm if mlp_post_norm is not None else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | DocumentSpans | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), cos, sin, mask, cache))
        return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


class Decoder(nn.Module):
    """A decoder-only language model assembled from blocks (see the module docstring for the contract)."""

    def __init__(self, embed: nn.Embedding, layers: Iterable[DecoderLayer], norm: nn.Module,
                 rope: RotaryEmbedding, *, tie_word_embeddings: bool = False, embed_scale: float | None = None,
                 local_rope: RotaryEmbedding | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rope = rope
        self.local_rope = local_rope
        vocab_size, hidden_size = embed.weight.shape
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        self.embed_scale = embed_scale
        self.logit_softcap = logit_softcap
        self.counted_for: tuple[torch.Tensor, torch.Tensor] | None = None  # ``counting``'s (input_ids, real tokens)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Re-tie the output head to the embedding: ``to_empty`` from the meta device (torch 2.13)
        gives every module its own fresh parameter, silently untying shared weights."""
        if self.tie_word_embeddings and self.output.weight is not self.embed.weight:
            self.output.weight = self.embed.weight

    def hidden_states(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                      padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq = input_ids.shape
        start = kv_cache.length if kv_cache is not None else 0
        if padding_mask is not None and padding_mask.shape != (batch, start + seq):
            raise ValueError(f"padding_mask must be [batch, cached + new tokens] = {[batch, start + seq]}, "
                             f"got {list(padding_mask.shape)}")
        given = positions  # with document_ids: may continue shared prefixes (modules/attention.py)
        if positions is None and padding_mask is not None:
            if document_ids is not None:
                raise ValueError("padding_mask and document_ids cannot be combined (a packed row has no padding)")
            positions = padded_positions(padding_mask)[:, start:]
        if positions is None:
            positions = default_positions(batch, seq, start=start, document_ids=document_ids,
                                          device=input_ids.device)
        if self.counted_for is not None:
            ids, real = self.counted_for
            for layer in self.moe_layers():
                layer.counted = real.reshape(-1) if ids is input_ids else None
        x = self.embed(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, device=x.device).to(x.dtype)  # fp32, then x's dtype
        # Packed rows: each document attends alone (modules/attention.py), found once for all layers.
        spans = (document_spans(document_ids, given) if document_ids is not None and kv_cache is None
                 and padding_mask is None else None)
        masks: dict[int | None, torch.Tensor | DocumentSpans | None] = {}  # one mask per distinct sliding window
        rotations: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # (cos, sin) per RoPE in use
        for index, layer in enumerate(self.layers):
            window = layer.attn.sliding_window
            if window not in masks:
                masks[window] = spans if spans is not None else attention_mask(
                    seq, start + seq, device=input_ids.device, document_ids=document_ids, sliding_window=window,
                    padding_mask=padding_mask)
            local = window is not None and self.local_rope is not None
            if local not in rotations:
                rotations[local] = (self.local_rope if local else self.rope)(positions)
            cache = kv_cache.layer(index) if kv_cache is not None else None
            x = layer(x, *rotations[local], masks[window], cache)
        if kv_cache is not None:
            kv_cache.advance(seq)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                padding_mask: torch.Tensor | None = None, logits_to_keep: int | None = None,
                logits_at: torch.Tensor | None = None, return_hidden: bool = False) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; ``logits_to_keep=k``: only the last k positions' (generation's
        prefill needs one row of ``[batch, prompt, vocab]``, which for a long prompt is most of the memory).

        ``logits_at`` (bool ``[batch, seq]``): only those positions' logits, ``[n, vocab]`` in row-major
        order; a loss passes its labelled positions, so prompts and padding never reach the vocabulary
        projection. A head sharded as a DTensor (tensor parallel: its input layout is the sequence's)
        cannot take gathered rows and returns the full ``[batch, seq, vocab]``: callers check ``dim()``.
        A plan that shards the head only for storage gathers it before this runs, so such a head selects.

        ``return_hidden``: the final hidden states instead (``hidden_states``), through ``forward`` so
        that wrappers hooked on it (FSDP2 gathers the embedding, final norm and head there) run: for
        losses that apply the head themselves, a chunk of rows at a time.
        """
        hidden = self.hidden_states(input_ids, positions=positions, document_ids=document_ids, kv_cache=kv_cache,
                                    padding_mask=padding_mask)
        if return_hidden:
            return hidden
        if logits_to_keep is not None:
            hidden = hidden[:, -logits_to_keep:]
        if logits_at is not None:
            return self.logits_of(hidden, logits_at)
        return self.logits(hidden)

    def aux_loss(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The weighted auxiliary loss recorded since the last call, and its parts; None if there is none.
        ``reduce``: sums a statistic over the data-parallel ranks (``moe.pop_aux_loss``)."""
        layers = self.moe_layers()
        return pop_aux_loss(layers, reduce) if layers else None

    def moe_layers(self) -> list[MoE]:
        return [module for module in self.modules() if isinstance(module, MoE)]

    @contextlib.contextmanager
    def counting(self, input_ids: torch.Tensor, real_tokens: torch.Tensor) -> Iterator[None]:
        """Within: a forward of exactly ``input_ids`` (this tensor, a micro-batch's) counts only its
        ``real_tokens`` (bool, the same shape) in the routing statistics; other forwards (another
        model input a method builds) count all of theirs. Every token is still routed."""
        if not self.moe_layers():
            yield
            return
        self.counted_for = (input_ids, real_tokens)
        try:
            yield
        finally:
            self.counted_for = None
            for layer in self.moe_layers():
                layer.counted = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over (some of) ``hidden_states``' rows, soft-capped if the model caps logits."""
        return soft_cap(self.output(hidden), self.logit_softcap)

    def logits_of(self, hidden: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """``logits(hidden[at])``, ``[n, vocab]`` (``forward(logits_at=...)``); a head sharded as a DTensor
        (tensor parallel: its input layout is the sequence's) takes no gathered rows and gives the full
        ``[batch, seq, vocab]`` logits instead: callers check ``dim()``."""
        if not any(hasattr(p, "placements") for p in self.output.parameters()):
            hidden = hidden[at]
        return self.logits(hidden)

    def extra_repr(self) -> str:
        options = [f"embed_scale={self.embed_scale:g}"] if self.embed_scale is not None else []
        if self.logit_softcap is not None:
            options.append(f"logit_softcap={self.logit_softcap:g}")
        return ", ".join(options)


def default_positions(batch: int, seq: int, *, start: int = 0, document_ids: torch.Tensor | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions [batch, seq]: ``start..start+seq-1``, or restarting at 0 at each document boundary."""
    index = torch.arange(start, start + seq, device=device).expand(batch, seq)
    if document_ids is None:
        return index
    boundary = torch.ones_like(document_ids, dtype=torch.bool)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(boundary, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def padded_positions(padding_mask: torch.Tensor) -> torch.Tensor:
    """Positions [batch, kv_len] of a left-padded batch: each row's first real token is 0.

    Padding keys get 0 as well; the mask hides them, so their rotation never matters.
    """
    return (padding_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
