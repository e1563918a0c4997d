"""Grouped-query self-attention over ``F.scaled_dot_product_attention``.

Masking is decided once per forward by ``attention_mask`` (causal, sliding window, packed
documents, KV-cache offsets, left padding) and shared by every layer with the same window.
Heads are reshaped with ``-1`` so a tensor-parallel (colwise) shard of q/k/v, which holds
fewer heads, runs unchanged.

Options families switch on: ``q_norm``/``k_norm`` are identities unless a family puts a
norm over head_dim there; ``rope=False`` makes a NoPE layer (no rotary embedding: SmolLM3's
every fourth layer); ``scale`` overrides 1/sqrt(head_dim); ``softcap`` bounds the scores
with ``cap * tanh(s / cap)`` before masking and softmax. SDPA cannot express soft-capping, and
flex attention has no backward on CPU, so a soft-capped layer runs ``explicit_attention``:
the textbook computation (scores, mask, fp32 softmax, weighted sum), exact and differentiable
everywhere, at the cost of materialising the [q, kv] score matrix. Layers without a cap keep
SDPA's fused kernels.

Packed rows (``document_ids``) take the per-document path: the decoder finds each row's
documents once per forward (``document_spans``, one host sync) and hands every layer that
``DocumentSpans`` in place of a mask. Each document then attends alone, with the fused causal
kernel, so the work is ``sum(len_i^2)`` rather than ``seq^2`` and no [b, 1, s, s] mask is
built: a packed row costs no more per token than a padded one. On CUDA, half-precision layers
without a soft-cap run all documents in one varlen flash call instead (``varlen_attn``). The
boolean mask stays for what needs it: KV caches, left padding, and document ids that do not
form contiguous runs.

Shared prefixes: with explicit ``positions``, a document whose first position is ``p > 0``
continues the first ``p`` tokens of the last document before it that starts at 0 (its root):
it attends to those keys, then causally to its own, exactly as if the prefix were written out
in front of it. Preference pairs use it to compute a prompt once for both responses (the chosen
one is the root, the rejected one continues its prompt); a root may have several continuations
(a group of completions of one prompt). The varlen call takes them too: a continued document's
keys are gathered (its root's first ones, then its own) and flash attention's causal window,
aligned to the last key, does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from posttune.modules.flex_attention import FlexMask  # hook for flex attention
from posttune.modules.kv_cache import LayerCache
from posttune.modules.rope import apply_rotary
from posttune.modules.softcap import soft_cap


def attention_mask(q_len: int, kv_len: int, *, device: torch.device | str = "cpu",
                   document_ids: torch.Tensor | None = None, sliding_window: int | None = None,
                   padding_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Boolean mask [batch or 1, 1, q_len, kv_len] (True = may attend), or None for plain causal.

    The queries are the last ``q_len`` of ``kv_len`` positions (a KV cache holds the rest).
    None lets SDPA use its fused causal path; it is returned only where that path is exact:
    no window, no documents, and either no cache offset or a single query.
    With ``document_ids`` [batch, seq] a query sees only earlier keys of its own document, so a
    packed row attends exactly as its documents would alone. A sliding window of ``w`` keeps
    keys with ``q - k < w`` (the current token and the w-1 before it).
    With ``padding_mask`` [batch, kv_len] (True = a real token; a left-padded batch) no query
    sees a padding key, except that every query sees its own key: a padding query would otherwise
    have no key at all, and the NaN of its empty softmax would reach real tokens in later layers
    (0 * NaN). Padding queries' outputs are meaningless and ignored by the caller.
    """
    if (document_ids is None and sliding_window is None and padding_mask is None
            and (q_len == kv_len or q_len == 1)):
        return None
    q_idx = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_idx = torch.arange(kv_len, device=device)[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (q_idx - k_idx < sliding_window)
    allowed = allowed[None, None]
    if document_ids is not None:
        if q_len != kv_len:
            raise ValueError("document_ids cannot be combined with a KV cache holding earlier tokens")
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]
        allowed = allowed & same_doc[:, None]
    if padding_mask is not None:
        if padding_mask.shape[-1] != kv_len:
            raise ValueError(f"padding_mask covers {padding_mask.shape[-1]} keys, the attention has {kv_len}")
        own_key = (k_idx == q_idx)[None, None]
        allowed = allowed & (padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :] | own_key)
    return allowed


Dense = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


# torch.compiler.disable, applied on the first call: as a decorator at import it imports torch._dynamo
# (1-2 s) into every process, `posttune generate` included, that never compiles. torch's own lazy form
# is private (torch._disable_dynamo), so it is looked up, not relied on: without it, the public one.
_outside_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


@dataclass(frozen=True, eq=False)
class DocumentSpans:
    """The documents of a packed batch, found once per forward and passed to every layer as its mask.

    ``lengths[r]`` are the lengths of row r's documents in order (runs of one document id; a
    row's tail padding is a document too, as in ``attention_mask``), summing to the row length.
    ``cu_seqlens`` (int32, on the batch's device, CUDA only) are the same boundaries over the
    flattened rows, what a varlen kernel takes; ``max_length`` the longest document.
    ``prefixes[r]`` (empty: none) are, per document of row r, how many leading tokens of its root
    it continues (0 for a document of its own; see the module docstring). For the varlen call a
    continued document's keys are its root's first ones and then its own: ``key_index`` (int64)
    picks each key of the call from the flattened rows, ``cu_seqlens_k``/``max_length_k`` bound
    them per document (None/0: the keys are the queries' tokens).
    """

    lengths: tuple[tuple[int, ...], ...]
    cu_seqlens: torch.Tensor | None = None
    max_length: int = 0
    prefixes: tuple[tuple[int, ...], ...] = ()
    key_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_length_k: int = 0

    @_outside_compile
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: Dense, *, window: int | None,
               softcap: float | None, scale: float | None) -> torch.Tensor:
        """q [b, heads, s, d], k/v [b, kv_heads, s, d] -> [b, heads, s, d], each document alone.

        Kept out of ``torch.compile`` graphs (a compiled layer graph-breaks here): the Python
        loop over documents would otherwise be traced, and recompiled, for every batch layout.
        """
        if self.cu_seqlens is not None and softcap is None and _flash_can_run(q):
            return self.varlen(q, k, v, window=window, scale=scale)
        return self.per_document(q, k, v, dense, window=window)

    def per_document(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: Dense, *,
                     window: int | None) -> torch.Tensor:
        """One ``dense`` call per document on views of the row (split/cat keep the backward cheap:
        no zero-filled full-size gradient per slice), causal unless a window binds. A continuation
        takes its root's first keys and values in front of its own, its queries the last ones."""
        rows = []
        for row, (q_row, k_row, v_row, lengths) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0),
                                                                 self.lengths)):
            prefixes = self.prefixes[row] if self.prefixes else (0,) * len(lengths)
            parts, root = [], (k_row[:, :0], v_row[:, :0])
            for q_doc, k_doc, v_doc, prefix in zip(q_row.split(lengths, 1), k_row.split(lengths, 1),
                                                   v_row.split(lengths, 1), prefixes):
                if prefix:
                    k_doc = torch.cat([root[0][:, :prefix], k_doc], dim=1)
                    v_doc = torch.cat([root[1][:, :prefix], v_doc], dim=1)
                    mask = attention_mask(q_doc.shape[1], k_doc.shape[1], device=q.device, sliding_window=window)
                else:
                    root = (k_doc, v_doc)
                    mask = _window_mask(q_doc.shape[1], window, q.device)
                parts.append(dense(q_doc[None], k_doc[None], v_doc[None], mask)[0])
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return torch.stack(rows)

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None,
               scale: float | None) -> torch.Tensor:
        """All documents in one varlen flash-attention call (CUDA, half precision). A continued
        document has more keys than queries: flash attention aligns its causal window to the last
        key (bottom-right), so its queries see the whole prefix and then their own earlier keys."""
        from torch.nn.attention.varlen import varlen_attn

        batch, heads, seq, head_dim = q.shape

        def tokens(t: torch.Tensor) -> torch.Tensor:  # [b, h, s, d] -> [b * s, h, d]
            return t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim)

        keys, values = tokens(k), tokens(v)
        cu_k, max_k = self.cu_seqlens, self.max_length
        if self.key_index is not None:
            keys, values = keys.index_select(0, self.key_index), values.index_select(0, self.key_index)
            cu_k, max_k = self.cu_seqlens_k, self.max_length_k
        left = -1 if window is None else window - 1  # a window of w keeps q - k < w
        out = varlen_attn(tokens(q), keys, values, self.cu_seqlens, cu_k, self.max_length, max_k, scale=scale,
                          window_size=(left, 0), enable_gqa=q.shape[1] != k.shape[1])
        return out.view(batch, seq, heads, head_dim).transpose(1, 2)


def _flash_can_run(q: torch.Tensor) -> bool:
    """What the varlen flash kernel takes: CUDA, half precision, head_dim a multiple of 8 up to 256."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256)


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """None (causal, the fused path) unless a sliding window is shorter than the document."""
    if window is None or length <= window:
        return None
    return attention_mask(length, length, device=device, sliding_window=window)


@_outside_compile
def document_spans(document_ids: torch.Tensor, positions: torch.Tensor | None = None) -> DocumentSpans | None:
    """The ``DocumentSpans`` of ``document_ids`` [b, s], or None when some row uses an id in two
    separate runs (only the mask is exact then). One device-to-host copy per forward (two with
    ``positions``, whose value at each document's start is the prefix it continues)."""
    ids = document_ids.detach().cpu()
    seq = ids.shape[1]
    starts = ids[:, 1:] != ids[:, :-1]
    rows, cuts = torch.nonzero(starts, as_tuple=True)
    boundaries: list[list[int]] = [[0] for _ in range(ids.shape[0])]
    for row, cut in zip(rows.tolist(), (cuts + 1).tolist()):
        boundaries[row].append(cut)
    starts_at = None if positions is None else positions.detach().cpu()
    lengths, prefixes = [], []
    for row, (row_ids, bounds) in enumerate(zip(ids, boundaries)):
        prefix = (0,) * len(bounds) if starts_at is None else tuple(starts_at[row, bounds].tolist())
        if len(bounds) != torch.unique(row_ids).numel():
            if any(prefix):
                raise ValueError("documents that continue a shared prefix must be contiguous runs of one id")
            return None
        bounds.append(seq)
        lengths.append(tuple(end - start for start, end in zip(bounds, bounds[1:])))
        prefixes.append(_checked_prefixes(lengths[-1], prefix, row))
    shared = tuple(prefixes) if any(any(row) for row in prefixes) else ()
    if document_ids.device.type != "cuda":
        return DocumentSpans(tuple(lengths), prefixes=shared)
    return varlen_spans(tuple(lengths), shared, seq, document_ids.device)


def varlen_spans(lengths: tuple[tuple[int, ...], ...], prefixes: tuple[tuple[int, ...], ...], seq: int,
                 device: torch.device) -> DocumentSpans:
    """``DocumentSpans`` with the boundaries a varlen kernel takes, on ``device`` (rows of ``seq`` tokens)."""
    flat = [length for row in lengths for length in row]
    offsets = torch.tensor([0, *flat], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    spans = DocumentSpans(lengths, offsets.to(device, non_blocking=True), max(flat), prefixes=prefixes)
    if not prefixes:
        return spans
    index, key_lengths = [], []
    for row, (row_lengths, row_prefixes) in enumerate(zip(lengths, prefixes)):
        start = root = row * seq
        for length, prefix in zip(row_lengths, row_prefixes):
            if prefix:
                index.append(torch.arange(root, root + prefix))
            else:
                root = start
            index.append(torch.arange(start, start + length))
            key_lengths.append(prefix + length)
            start += length
    key_offsets = torch.tensor([0, *key_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return replace(spans, key_index=torch.cat(index).to(device, non_blocking=True),
                   cu_seqlens_k=key_offsets.to(device, non_blocking=True), max_length_k=max(key_lengths))


def _checked_prefixes(lengths: tuple[int, ...], prefixes: tuple[int, ...], row: int) -> tuple[int, ...]:
    """``prefixes`` as given, once each is known to fit inside its root (the last document before
    it that starts at position 0)."""
    root = None
    for index, (length, prefix) in enumerate(zip(lengths, prefixes)):
        if prefix == 0:
            root = length
        elif root is None or not 0 < prefix <= root:
            raise ValueError(f"row {row}, document {index}: positions start at {prefix}, but no earlier "
                             f"document starting at 0 has that many tokens to continue")
    return prefixes


class Attention(nn.Module):
    """Causal GQA: ``num_heads`` query heads share ``num_kv_heads`` key/value heads."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, bias: bool = False, out_bias: bool | None = None,
                 sliding_window: int | None = None, scale: float | None = None, softcap: float | None = None,
                 rope: bool = True):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.sliding_window = sliding_window
        self.scale = scale
        self.softcap = softcap
        self.use_rope = rope
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias if out_bias is None else out_bias)
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | DocumentSpans | FlexMask | None, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        if isinstance(mask, FlexMask):  # hook: flex attention (modules/flex_attention.py), e.g. context parallel
            out = mask.attend(q, k, v, scale=self.scale, softcap=self.softcap)
        elif isinstance(mask, DocumentSpans):
            out = mask.attend(q, k, v, self.dense, window=self.sliding_window, softcap=self.softcap, scale=self.scale)
        else:
            out = self.dense(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over whole rows with a boolean mask (None = causal): SDPA, or the explicit
        computation for a soft-capped layer."""
        if self.softcap is not None:
            return explicit_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)
        # a plain bool: ``mask is None and seq > 1`` would be a symbolic bool under compile's dynamic
        # shapes and split the graph here
        causal = True if mask is None and q.shape[2] > 1 else False  # noqa: SIM210
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """[batch, seq, heads*head_dim] -> [batch, heads, seq, head_dim]."""
        batch, seq, _ = projected.shape
        return projected.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        scale = f", scale={self.scale:g}" if self.scale is not None else ""
        cap = f", softcap={self.softcap:g}" if self.softcap is not None else ""
        nope = "" if self.use_rope else ", rope=False"
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                f"{window}{scale}{cap}{nope}")


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                       scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention written out, for what SDPA cannot fuse (soft-capped scores).

    q [b, heads, q_len, d], k/v [b, kv_heads, kv_len, d]; ``mask`` is what ``attention_mask``
    returns (None = causal, queries last). The softmax runs in fp32 and is cast back before the
    weighted sum, as the reference implementations do, so bf16 rounds the same way.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = soft_cap(torch.matmul(q, k.transpose(-2, -1)) * scale, softcap)
    q_len, kv_len = q.shape[2], k.shape[2]
    if mask is None and q_len > 1:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)
