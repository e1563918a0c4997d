"""Tensor-parallel styles by native module name (fnmatch patterns), applied by the TP plugin.

The Llama plan, which torchtitan and transformers' own Qwen plans share: q/k/v and gate/up
split their output features ("colwise", Qwen2's q/k/v biases split with them), o/down split
their input features ("rowwise"), norms run sequence-parallel between blocks, the embedding
is split by vocabulary rows and the output head by vocabulary columns.

Qwen3's ``q_norm``/``k_norm`` normalise each head over ``head_dim``, and a colwise shard holds
whole heads, so each rank applies the whole (replicated) weight to its own heads and the
weight's gradient is summed over the ranks (``per_head``; transformers'
``replicated_with_grad_allreduce`` for the same modules).
"""

from __future__ import annotations

from posttune.plugin import DECODER_TP_PLAN

TP_PLAN: dict[str, str] = dict(DECODER_TP_PLAN)
QWEN3_TP_PLAN: dict[str, str] = {**TP_PLAN, "layers.*.attn.q_norm": "per_head", "layers.*.attn.k_norm": "per_head"}

#: MoE families: attention, embedding, head and norms as above; each layer's feed-forward (router,
#: experts, shared expert; a dense layer's MLP too) runs whole on every TP rank ("replicated")
def moe_tp_plan(dense: dict[str, str]) -> dict[str, str]:
    return {**{pattern: style for pattern, style in dense.items() if ".mlp." not in pattern},
            "layers.*.mlp": "replicated"}


TP_PLANS = {"qwen2": TP_PLAN, "qwen3": QWEN3_TP_PLAN, "qwen2_moe": moe_tp_plan(TP_PLAN),
            "qwen3_moe": moe_tp_plan(QWEN3_TP_PLAN)}
