"""Tensor-parallel styles by native module name (fnmatch patterns), applied by the TP plugin.

Styles follow torchtitan's Llama plan: q/k/v and gate/up split their output features
("colwise"), o/down split their input features ("rowwise") so each block needs one reduction;
norms run sequence-parallel between blocks; the embedding is split by vocabulary rows and the
output head by vocabulary columns (which also suits tied weights: both split the vocab dim).
Attention reshapes heads with -1, so a shard holding num_heads/tp heads runs unchanged.
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
