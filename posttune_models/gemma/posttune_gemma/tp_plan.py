"""Tensor-parallel styles by native module name (fnmatch patterns), applied by the TP plugin.

The Llama plan (q/k/v and gate/up colwise, o/down rowwise, norms sequence-parallel, embedding
rowwise and output colwise over the vocabulary) plus Gemma 2/3's post-norms, which sit between
a rowwise projection and the residual and so run sequence-parallel like the pre-norms.
Gemma 3's q/k norms act on whole heads after the colwise split: each rank normalises its own
heads with the full (replicated) weight, whose gradient is summed over the ranks (``per_head``).
Soft-capping and the explicit attention path are per-head and per-token, so a head shard runs them
unchanged.
"""

from __future__ import annotations

from posttune.plugin import DECODER_TP_PLAN

GEMMA_TP_PLAN: dict[str, str] = dict(DECODER_TP_PLAN)

#: Gemma 2 and 3: the same, plus the post-norms (identities in Gemma 1, so not named there)
GEMMA2_TP_PLAN: dict[str, str] = {
    **GEMMA_TP_PLAN,
    "layers.*.attn_post_norm": "sequence_parallel",
    "layers.*.mlp_post_norm": "sequence_parallel",
}

#: Gemma 3: the same, plus its per-head q/k norms
GEMMA3_TP_PLAN: dict[str, str] = {**GEMMA2_TP_PLAN, "layers.*.attn.q_norm": "per_head",
                                  "layers.*.attn.k_norm": "per_head"}
