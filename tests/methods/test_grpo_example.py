"""The bundled CPU example, in full (slow): prepare the warm start, then GRPO -- sync, and async on Ray
-- raises the mean reward: the last 10 steps' mean beats the first 10's by the margin the config states."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest

import posttune_grpo

pytestmark = pytest.mark.slow
CONFIG = posttune_grpo.CONFIGS / "grpo-tiny-reverse.yaml"


def stated_margin() -> float:
    return float(re.search(r"^# reward rise: ([0-9.]+)", CONFIG.read_text(), re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-example") / "start"
    prepared = subprocess.run([sys.executable, "-m", "posttune_grpo.example", "prepare", "--out", str(out)],
                              capture_output=True, text=True, timeout=900)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_cpu_example_raises_the_mean_reward(warm_start, tmp_path, mode):
    if mode == "async":
        pytest.importorskip("ray", reason="async mode needs pip install 'posttune-grpo[ray]'")
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", "grpo-tiny-reverse",
                          f"model.path={warm_start}", f"checkpoint.output_dir={out}", f"method.mode={mode}"],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = statistics.mean(r["reward"] for r in steps[:10])
    last = statistics.mean(r["reward"] for r in steps[-10:])
    assert last >= first + stated_margin(), (first, last)
    assert (out / "model" / "config.json").is_file()
