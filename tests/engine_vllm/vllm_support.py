"""Shared by the vllm tests: prompts, sampling settings, the learner's log-probs of a completion."""

from __future__ import annotations

import torch
from posttune.plugin import EnginePolicy, Sampling

PROMPTS = [[5, 17, 300, 42, 8, 9, 10], [9, 4], [7, 7, 7, 120]]  # of different lengths
STOP = (2,)
GREEDY = Sampling(12, stop_token_ids=STOP, pad_id=0)
SAMPLED = Sampling(12, temperature=1.0, top_p=0.9, top_k=40, stop_token_ids=STOP, pad_id=0)
SEEDS = [101, 202, 303]


def live(model: torch.nn.Module, version: int) -> EnginePolicy:
    """What a method starts an engine on: the live policy in this process."""
    origin = model.posttune_origin
    return EnginePolicy(origin.family, origin.build_kwargs, model=model, source=origin.source, version=version)


def recomputed(model, prompts, out, temperature: float = 1.0) -> list[torch.Tensor]:
    """The learner's log-probs of each generated token: log_softmax(logits / T) of a plain forward pass."""
    rows = []
    for prompt, tokens, keep in zip(prompts, out.tokens, out.mask, strict=True):
        ids = torch.tensor([prompt + tokens[keep].tolist()])
        with torch.no_grad():
            logps = (model(ids).float() / temperature).log_softmax(-1)[0, len(prompt) - 1:-1]
        rows.append(logps.gather(-1, ids[0, len(prompt):, None])[:, 0])
    return rows


def assert_logprobs_match(model, prompts, out, temperature: float = 1.0, tol: float = 1e-4) -> None:
    for row, reference in enumerate(recomputed(model, prompts, out, temperature)):
        got = out.logprobs[row][out.mask[row]]
        assert torch.allclose(got, reference, atol=tol, rtol=0), (row, (got - reference).abs().max())
