"""Tokens/s over the timed steps, the same way for every side."""

from __future__ import annotations

import resource
from typing import Any


def peak_rss_mib() -> float:
    """This process's peak resident memory (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarise(tokens: list[int], seconds: list[float], warmup: int) -> dict[str, Any]:
    """Non-padding tokens per second over the steps after ``warmup``, and the per-step lists."""
    timed_tokens, timed_seconds = tokens[warmup:], seconds[warmup:]
    if not timed_tokens:
        raise SystemExit(f"no timed step: {len(tokens)} step(s), {warmup} warm-up")
    return {
        "steps": len(tokens),
        "timed_steps": len(timed_tokens),
        "timed_tokens": sum(timed_tokens),
        "timed_seconds": round(sum(timed_seconds), 4),
        "tokens_per_s": round(sum(timed_tokens) / max(sum(timed_seconds), 1e-9), 1),
        "step_tokens": tokens,
        "step_seconds": [round(s, 4) for s in seconds],
    }


def posttune_steps(records: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """(tokens, seconds, loss) per step from a run's metrics.jsonl records.

    posttune logs ``tokens`` (the batch's non-padding tokens) and ``tokens_per_s`` = tokens over
    the step's wall time, from the end of the previous step (batch fetch, forward, backward,
    clip, optimizer step); the time is recovered as their quotient.
    """
    steps = [r for r in records if "tokens_per_s" in r]
    tokens = [int(r["tokens"]) for r in steps]
    seconds = [r["tokens"] / r["tokens_per_s"] for r in steps]
    return tokens, seconds, [float(r["loss"]) for r in steps]
