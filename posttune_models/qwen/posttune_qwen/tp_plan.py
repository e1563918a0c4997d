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

from posttune.plugin import DECODER_TP_PLAN

TP_PLAN: dict[str, str] = dict(DECODER_TP_PLAN)

#: MoE families: attention, embedding, head and norms as above; the experts stay whole on each rank
#: (the expert-parallel plan shards them), and so do the router and shared experts
MOE_TP_PLAN: dict[str, str] = {pattern: style for pattern, style in TP_PLAN.items() if ".mlp." not in pattern}
