"""Tensor-parallel styles by native module name (fnmatch patterns), applied by the TP plugin.

The Llama plan, which torchtitan and transformers' own Qwen plans share: q/k/v and gate/up
split their output features ("colwise", Qwen2's q/k/v biases split with them), o/down split
their input features ("rowwise"), norms run sequence-parallel between blocks, the embedding
is split by vocabulary rows and the output head by vocabulary columns.

Qwen3's ``q_norm``/``k_norm`` are absent on purpose: they normalise each head over
``head_dim``, and a colwise shard holds whole heads, so their weights stay replicated (as
transformers' ``replicated_with_grad_allreduce`` for the same modules).
"""

from __future__ import annotations

TP_PLAN: dict[str, str] = {
    "embed": "rowwise",
    "layers.*.attn_norm": "sequence_parallel",
    "layers.*.attn.q_proj": "colwise",
    "layers.*.attn.k_proj": "colwise",
    "layers.*.attn.v_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp_norm": "sequence_parallel",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "sequence_parallel",
    "output": "colwise",
}
