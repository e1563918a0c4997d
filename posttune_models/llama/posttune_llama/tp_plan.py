"""Tensor-parallel styles by native module name, applied by the TP plugin: Llama and Mistral
use the core decoder blocks unchanged, so their plan is the core's (``DECODER_TP_PLAN``, whose
comment explains each style)."""

from __future__ import annotations

from posttune.plugin import DECODER_TP_PLAN

TP_PLAN: dict[str, str] = dict(DECODER_TP_PLAN)
