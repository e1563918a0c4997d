"""Rotary position embeddings (RoPE) with the scaling variants released checkpoints use.

Layout: posttune keeps the "rotate-half" layout that Hugging Face checkpoints are stored in
(the first half of each head's dimensions pairs with the second half), so HF q/k weights load
without any permutation.

``scaling`` is the checkpoint's RoPE dict as found in config.json (``rope_parameters`` in
transformers 5, ``rope_scaling`` before): a ``rope_type`` (or legacy ``type``) plus that
variant's parameters. None means plain RoPE. Frequencies are computed in fp32, as the
checkpoints were trained with them.

Partial rotary embeddings (Phi-4-mini rotates 3/4 of each head): build the RoPE with the rotated
width as its ``head_dim``; ``apply_rotary`` rotates as many leading dimensions of each head as
cos/sin have and passes the rest through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from posttune.errors import PosttuneError

Frequencies = tuple[torch.Tensor, float]  # inverse frequencies [dim/2], attention factor for cos/sin


def _base(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _default(dim: int, theta: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None) -> Frequencies:
    return _base(dim, theta), 1.0


def _linear(dim: int, theta: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None) -> Frequencies:
    """Position interpolation: every position is divided by ``factor``."""
    return _base(dim, theta) / p["factor"], 1.0


def _dynamic(dim: int, theta: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None) -> Frequencies:
    """Dynamic NTK: plain RoPE up to ``max_pos``; beyond it the base grows with the sequence length."""
    seq_len = max(seq_len or max_pos, max_pos)
    factor = p["factor"]
    theta = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base(dim, theta), 1.0


def _llama3(dim: int, theta: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None) -> Frequencies:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp between."""
    inv_freq = _base(dim, theta)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p.get("original_max_position_embeddings") or max_pos
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(dim: int, theta: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None) -> Frequencies:
    """YaRN: interpolate low frequencies, extrapolate high ones, and rescale attention (cos/sin)."""
    old_len = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / old_len
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolated = _base(dim, theta)
    interpolated = extrapolated / factor
    keep = 1 - ramp  # 1 where a dimension keeps its original (extrapolated) frequency
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(dim: int, theta: float, p: Mapping[str, Any], max_pos: int, seq_len: int | None) -> Frequencies:
    """LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by its own factor, ``short_factor`` up to
    ``original_max_position_embeddings`` and ``long_factor`` for a forward whose positions go past it;
    cos/sin scaled by ``sqrt(1 + ln(s) / ln(original))`` with s = ``factor``, else max_pos / original
    (or by ``attention_factor`` when given)."""
    old_len = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / old_len
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    name = "long_factor" if seq_len is not None and seq_len > old_len else "short_factor"
    factors = torch.tensor(p[name], dtype=torch.float32, device="cpu")
    if factors.shape != (dim // 2,):
        raise PosttuneError(f"RoPE scaling: longrope's {name} must list {dim // 2} numbers (one per rotated "
                            f"frequency), got {len(p[name])}")
    return _base(dim, theta) / factors, float(attention_factor)


ROPE_TYPES: dict[str, Callable[[int, float, Mapping[str, Any], int, int | None], Frequencies]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}
#: variants whose frequencies depend on the longest position of a forward
GROWING = ("dynamic", "longrope")


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The variant a RoPE dict names; an unknown one is a one-line PosttuneError."""
    name = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if name not in ROPE_TYPES:
        raise PosttuneError(f"unknown RoPE scaling type '{name}' (supported: {', '.join(sorted(ROPE_TYPES))})")
    return name


def split_rope_parameters(params: Mapping[str, Any] | None, *, theta: float | None = None,
                          default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from one RoPE dict of a config.json, in either spelling.

    transformers 5 keeps ``rope_theta`` inside ``rope_parameters``; older files carry it next to
    ``rope_scaling`` (pass it as ``theta``). A legacy ``type`` key becomes ``rope_type``; plain
    RoPE gives None; an unknown type is a one-line PosttuneError, raised before any weight loads.
    """
    params = dict(params or {})
    value = params.pop("rope_theta", None) or theta or default_theta
    name = rope_type(params)
    params.pop("type", None)
    if name == "default":
        return float(value), None
    return float(value), {**params, "rope_type": name}


def read_rope(config: Mapping[str, Any], family: str, *, partial: bool = False) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from a whole config.json: ``rope_parameters`` (transformers 5)
    or ``rope_theta`` + ``rope_scaling`` (older files); a file with both reads ``rope_scaling`` (and a
    top-level ``rope_theta`` where its dict has none), as transformers does. Partial rotary embeddings
    are refused unless the family builds them (``partial``; ``rotary_fraction`` reads the fraction). A top-level
    ``original_max_position_embeddings`` (Phi-3's spelling) goes into a LongRoPE dict, over the dict's
    own value, as transformers reads it."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if not partial and rotary_fraction(config) != 1.0:
        raise PosttuneError(f"config.json: partial_rotary_factor is not supported by the {family} family")
    params.pop("partial_rotary_factor", None)
    theta, scaling = split_rope_parameters(params, theta=config.get("rope_theta"))
    original = config.get("original_max_position_embeddings")
    if scaling is not None and original and scaling["rope_type"] == "longrope":
        scaling["original_max_position_embeddings"] = original
    return theta, scaling


def rotary_fraction(config: Mapping[str, Any]) -> float:
    """The fraction of each head RoPE rotates: ``partial_rotary_factor`` at the top of config.json or
    (transformers 5) inside ``rope_parameters``; 1.0 when absent."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return float(config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


def rope_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None, *,
                     max_position_embeddings: int = 2048, seq_len: int | None = None) -> Frequencies:
    """Inverse frequencies (fp32, CPU) and the factor cos/sin are multiplied by."""
    return ROPE_TYPES[rope_type(scaling)](head_dim, theta, scaling or {}, max_position_embeddings, seq_len)


class RotaryEmbedding(nn.Module):
    """Turns positions [batch, seq] into (cos, sin) [batch, seq, head_dim] in fp32.

    One instance serves every layer of a model. ``inv_freq`` is a non-persistent fp32 buffer:
    checkpoints never carry it, so ``init_buffers()`` recomputes it after ``to_empty``; if a
    ``model.to(torch.bfloat16)`` casts it, forward recomputes fp32 frequencies rather than
    rotating with bf16-rounded angles.
    """

    def __init__(self, head_dim: int, *, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None,
                 max_position_embeddings: int = 2048):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.rope_type = rope_type(scaling)
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.init_buffers()

    def _frequencies(self, seq_len: int | None = None) -> Frequencies:
        return rope_frequencies(self.head_dim, self.theta, self.scaling,
                                max_position_embeddings=self.max_position_embeddings, seq_len=seq_len)

    def init_buffers(self) -> None:
        inv_freq, self.attention_factor = self._frequencies()
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # `model.to(bf16)` cast the buffer: don't rotate with bf16 angles
            inv_freq = self._frequencies()[0].to(positions.device)
        if self.rope_type in GROWING:  # stateless: frequencies follow this call's longest position
            seq_len = int(positions.max()) + 1
            if seq_len > self._grows_after():
                inv_freq = self._frequencies(seq_len)[0].to(positions.device)
        angles = positions[..., None].float() * inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        if self.attention_factor == 1.0:  # plain RoPE: no extra pass over cos and sin
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    @property
    def switch_length(self) -> int | None:
        """LongRoPE: the length past which a forward rotates every position, earlier ones included, with
        the long factors (a KV cache filled before it is stale after it); None for the other variants."""
        return self._grows_after() if self.rope_type == "longrope" else None

    def _grows_after(self) -> int:
        """The longest forward the frequencies of ``init_buffers`` serve (dynamic NTK, LongRoPE's short factors)."""
        if self.rope_type == "longrope":
            return self.scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        return self.max_position_embeddings

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, type={self.rope_type}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, heads, seq, head_dim] by (cos, sin) [batch, seq, head_dim].

    cos/sin are cast to x's dtype first, as the reference implementation does, so bf16 models
    round the same way. cos/sin narrower than the head rotate its leading dimensions only (partial
    rotary); the rest pass through.
    """
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin
