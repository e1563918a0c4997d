"""The benchmark scripts that are run by hand (on an idle machine, on a lent GPU) still run: their
smoke modes end with a JSON report whose numbers are there and positive. Minutes of tooling that no user
runs, so `tox -e extended` runs them (before a change to a benchmark script lands), not the default run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from run_support import run_python

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
pytestmark = pytest.mark.extended


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


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (the HF side)")
def test_moe_quick_times_every_contender_on_the_same_weights(tmp_path):
    """benchmarks/moe.py --quick: posttune (grouped and loop) and transformers (default and eager
    experts) train the same tiny Qwen3-MoE checkpoint; every contender has timed rounds, the two
    libraries' logits and first losses agree, and the peak-RSS children report."""
    out = tmp_path / "moe.json"
    run_python(str(BENCHMARKS / "moe.py"), "--quick", "--out", str(out), timeout=600)
    report = json.loads(out.read_text())
    assert report["settings"]["quick"] is True and report["settings"]["dtypes"] == ["fp32"]
    result = report["results"]["fp32"]
    assert set(result["contenders"]) == {"posttune", "posttune-loop", "hf", "hf-eager"}
    for name, row in result["contenders"].items():
        assert len(row["tokens_per_s_rounds"]) == report["settings"]["rounds"], name
        assert row["tokens_per_s_median"] > 0, name
    for side in ("posttune", "hf"):
        row = result["contenders"][side]
        assert row["peak_rss_mib"] >= row["loaded_rss_mib"] >= row["import_rss_mib"] > 0, side
    for name in ("posttune/hf", "posttune/hf-eager", "posttune/posttune-loop", "peak_rss posttune/hf"):
        assert result["ratios"][name] > 0, name
    assert result["hf_experts_implementation"] == {"hf": "grouped_mm", "hf-eager": "eager"}
    assert result["logits_max_abs_diff"] < 1e-4
    losses = list(result["first_step_loss"].values())
    assert max(losses) - min(losses) < 1e-4


def test_compare_profile_reports_each_operator_s_share_of_a_run(monkeypatch):
    """compare.py --profile: a child's run under torch.profiler reports its operators by self CPU time, per step,
    with shares of all operators' time (the top ones and the rest sum to 1); a run of matrix multiplies puts
    aten::mm first."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from compare_support.timing import profiled

    def run(spec):  # a long inner dimension: the multiply outweighs tanh even where matmuls are fastest (AMX)
        x, w = torch.randn(256, 4096), torch.randn(4096, 256) / 64
        for _ in range(spec["steps"] * 4):
            torch.tanh(x @ w)
        return {"steps": spec["steps"], "step_seconds": [0.5] * spec["steps"]}

    run({"steps": 1})  # first calls (kernel selection, thread pools) outside the profile
    result, profile = profiled(run, {"steps": 2}, top=3)
    assert result["steps"] == 2 and profile["wall_seconds_per_step"] == 0.5
    assert profile["top"][0]["name"] == "aten::mm" and profile["top"][0]["calls"] == 8
    assert len(profile["top"]) == 3
    assert abs(sum(op["share"] for op in profile["top"]) + profile["other"]["share"] - 1) < 1e-3
    assert profile["operators_seconds_per_step"] > 0


@pytest.mark.slow
def test_compile_quick_trains_eager_and_compiled(tmp_path):
    """benchmarks/compile.py --quick: the technique's own code (``posttune_memory.compile.apply``) on a tiny
    Llama, eager and compiled, each with timed steps and a peak RSS (it had broken when the technique's
    recompile bound began reading ``config.train``)."""
    out = tmp_path / "compile.json"
    run_python(str(BENCHMARKS / "compile.py"), "--quick", "--out", str(out), timeout=600)
    report = json.loads(out.read_text())
    for mode in ("eager", "compiled"):
        assert report[mode]["tokens_per_s_median"] > 0 and report[mode]["peak_rss_mib_median"] > 0, mode
    assert report["ratio_tokens_per_s"] > 0 and report["runs_per_mode"] == 1
    assert report["compiled"]["warmup_seconds_median"] > 0 and report["compiled"]["threads"][0] >= 1
