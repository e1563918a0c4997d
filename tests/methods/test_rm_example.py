"""The bundled reward-model example, in full: validation reward accuracy climbs from chance (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: measured on this machine kind, seeds 0-2 with 1 and 2 threads: 0.48-0.55 at step 100 and
#: 0.76-0.94 at step 1000 (rises 0.28-0.44); margins below the least of them
MIN_FINAL_ACCURACY = 0.7
MIN_RISE = 0.2


@pytest.mark.slow
def test_the_tiny_reward_model_example_raises_validation_accuracy(tmp_path):
    out = tmp_path / "rm"
    run = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", "rm-tiny-reverse",
                          f"checkpoint.output_dir={out}"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    evaluations = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                   if "val_rewards/accuracy" in r]
    assert [r["step"] for r in evaluations] == list(range(100, 1001, 100))
    first, last = evaluations[0]["val_rewards/accuracy"], evaluations[-1]["val_rewards/accuracy"]
    assert last >= MIN_FINAL_ACCURACY and last >= first + MIN_RISE, (first, last)
    assert evaluations[-1]["val_loss"] < evaluations[0]["val_loss"]
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"]
