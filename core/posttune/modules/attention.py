"""Grouped-query self-attention over ``F.scaled_dot_product_attention``.

Masking is decided once per forward by ``attention_mask`` (causal, sliding window, packed
documents, KV-cache offsets, left padding) and shared by every layer with the same window.
Heads are reshaped with ``-1`` so a tensor-parallel (colwise) shard of q/k/v, which holds
fewer heads, runs unchanged.

Options families switch on: ``q_norm``/``k_norm`` are identities unless a family puts a
norm over head_dim there; ``scale`` overrides 1/sqrt(head_dim); ``softcap`` bounds the scores
with ``cap * tanh(s / cap)`` before masking and softmax. SDPA cannot express soft-capping, and
flex attention has no backward on CPU, so a soft-capped layer runs ``explicit_attention``:
the textbook computation (scores, mask, fp32 softmax, weighted sum), exact and differentiable
everywhere, at the cost of materialising the [q, kv] score matrix. Layers without a cap keep
SDPA's fused kernels.
"""

from __future__ import annotations

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


class Attention(nn.Module):
    """Causal GQA: ``num_heads`` query heads share ``num_kv_heads`` key/value heads."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, bias: bool = False, out_bias: bool | None = None,
                 sliding_window: int | None = None, scale: float | None = None, softcap: float | None = None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.sliding_window = sliding_window
        self.scale = scale
        self.softcap = softcap
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias if out_bias is None else out_bias)
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        if isinstance(mask, FlexMask):  # hook: flex attention (modules/flex_attention.py), e.g. context parallel
            out = mask.attend(q, k, v, scale=self.scale)
        elif self.softcap is not None:
            out = explicit_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1,
                                                 scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """[batch, seq, heads*head_dim] -> [batch, heads, seq, head_dim]."""
        batch, seq, _ = projected.shape
        return projected.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        scale = f", scale={self.scale:g}" if self.scale is not None else ""
        cap = f", softcap={self.softcap:g}" if self.softcap is not None else ""
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}{scale}{cap}"


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
