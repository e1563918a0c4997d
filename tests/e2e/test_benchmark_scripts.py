"""The benchmark scripts that are run by hand (on an idle machine, on a lent GPU) still run: their
smoke modes end with a JSON report whose numbers are there and positive."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from run_support import run_python

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.slow
def test_gpu_benchmark_cpu_smoke_runs_its_code_path(tmp_path):
    """benchmarks/gpu.py --cpu-smoke: the GPU script's path (compose, packing, the memory
    techniques, fsdp2 listed) with a tiny fp32 model on CPU."""
    out = tmp_path / "gpu.json"
    run_python(str(BENCHMARKS / "gpu.py"), "--cpu-smoke", "--threads", "1", "--out", str(out), timeout=600)
    report = json.loads(out.read_text())
    assert report["cpu_smoke"] is True
    (model,) = report["models"]
    for field in ("tokens_per_s", "mfu", "peak_memory_mib", "parameters", "flops_per_token", "timed_tokens"):
        assert model[field] > 0, field
    assert model["steps"] == 3 and model["timed_steps"] == 2
    assert "chunked_cross_entropy" in model["memory"] and model["parallel_plans"] == ["fsdp2"]
    assert model["active_parallel_plans"] == []  # one process: posttune runs the plans inactive


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (the HF side)")
def test_compare_quick_full_sft_runs_both_sides_on_the_same_batches(tmp_path):
    """benchmarks/compare.py --quick --mode full --runs 1: posttune and the HF Trainer each train
    once, on the same batches, from the same weights (so their first losses agree)."""
    out = tmp_path / "compare.json"
    run_python(str(BENCHMARKS / "compare.py"), "--quick", "--mode", "full", "--runs", "1", "--out", str(out),
               timeout=900)
    report = json.loads(out.read_text())
    assert [(run["side"], run["mode"]) for run in report["runs"]] == [("posttune", "full"), ("hf", "full")]
    for run in report["runs"]:
        for field in ("tokens_per_s", "peak_rss_mib", "steps", "timed_tokens"):
            assert run[field] > 0, (run["side"], field)
    summary = report["summary"]["full"]
    for side in ("posttune", "hf"):
        assert summary[side]["tokens_per_s_median"] > 0 and summary[side]["peak_rss_mib_median"] > 0
    assert summary["tokens_per_s_ratio"] > 0 and summary["peak_rss_ratio"] > 0
    assert summary["same_batches"] is True
    assert summary["max_step_loss_difference"] < 1e-3
