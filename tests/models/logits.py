"""Logits of a native model and of transformers on the same fixed ids, for checkpoint tests."""

from __future__ import annotations

import torch
import transformers

IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
FP32_TOLERANCE = 1e-4


def transformers_logits(path_or_model) -> torch.Tensor:
    model = path_or_model
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path_or_model, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(IDS).logits


def native_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).float()


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= FP32_TOLERANCE
