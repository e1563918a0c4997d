"""The bundled mixture-of-experts example, in full: a tiny Mixtral learns string reversal on CPU and
logs its routing (slow, ~1.5 min)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: measured on this CPU: val_loss 3.08 at step 50 and 0.008 at step 250; thresholds with margins that
#: hold on CPUs whose rounding moves the trajectory a little
MIN_FIRST, MAX_LAST = 1.0, 0.1


@pytest.mark.slow
@pytest.mark.example
def test_the_tiny_mixtral_example_learns_and_logs_its_routing(tmp_path):
    out = tmp_path / "moe"
    run = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", "mixtral-tiny-reverse",
                          f"checkpoint.output_dir={out}"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluations] == [50, 100, 150, 200, 250]
    assert evaluations[0]["val_loss"] > MIN_FIRST and evaluations[-1]["val_loss"] < MAX_LAST
    steps = [r for r in records if "aux_loss" in r]
    assert len(steps) == 250 and all(r["expert_tokens_max"] > 0 for r in steps)
    # the training loss carries 0.02 x the load-balancing loss on top of the cross-entropy
    last = steps[-1]
    assert last["loss"] - evaluations[-1]["val_loss"] == pytest.approx(0.02 * last["aux_loss"], abs=0.02)
    assert (out / "model" / "config.json").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
