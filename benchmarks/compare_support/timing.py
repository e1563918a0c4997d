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


def profiled(run: Any, spec: dict[str, Any], top: int = 30) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run(spec)`` under torch.profiler (CPU): its result, and the ``top`` operators by self CPU time over the
    whole run (setup, warm-up and timed steps; setup is a small share of a run of a dozen steps), each with its
    share of all operators' self time, its calls and its seconds per step. ``other`` sums the rest; the gap
    between the steps' wall time and the operators' total is Python and dispatch outside any operator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run(spec)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    steps = max(int(result.get("steps", 1)), 1)
    ops = [{"name": e.key, "share": round(e.self_cpu_time_total / 1e6 / total, 4), "calls": e.count,
            "seconds_per_step": round(e.self_cpu_time_total / 1e6 / steps, 4)} for e in events[:top]]
    rest = sum(e.self_cpu_time_total for e in events[top:]) / 1e6
    return result, {"operators_seconds_per_step": round(total / steps, 4),
                    "wall_seconds_per_step": round(sum(result.get("step_seconds", [])) / steps, 4),
                    "top": ops, "other": {"share": round(rest / total, 4), "seconds_per_step": round(rest / steps, 4)}}
