"""Tensor-parallel styles by native module name, applied by the TP plugin: Llama and Mistral
use the core decoder blocks unchanged, so their plan is the core's (``DECODER_TP_PLAN``, whose
comment explains each style); Mixtral's splits attention the same way and runs each layer's
mixture of experts whole on every TP rank ("replicated")."""

from __future__ import annotations

from posttune.plugin import DECODER_TP_PLAN

TP_PLAN: dict[str, str] = dict(DECODER_TP_PLAN)

#: Mixtral: attention, embedding, head and norms as above; the router and the stacked experts are no
#: linear layers a TP style splits, so each layer's mixture runs whole on every rank (an
#: expert-parallel plan is what shards experts)
MOE_TP_PLAN: dict[str, str] = {**{pattern: style for pattern, style in TP_PLAN.items() if ".mlp." not in pattern},
                               "layers.*.mlp": "replicated"}
