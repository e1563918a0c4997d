"""The bundled CPU example, in full (slow): prepare the warm start, then GRPO -- sync, and async on Ray
-- raises the mean reward: the last 20 steps' mean beats the first 20's by the margin the config states."""

from __future__ import annotations

import json
import statistics

import posttune_grpo
import pytest
from run_support import run_python, stated_number

pytestmark = pytest.mark.slow
CONFIG = posttune_grpo.CONFIGS / "grpo-tiny-reverse.yaml"


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-example") / "start"
    run_python("-m", "posttune_grpo.example", "prepare", "--out", str(out), timeout=900)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_cpu_example_raises_the_mean_reward(warm_start, tmp_path, mode):
    if mode == "async":
        pytest.importorskip("ray", reason="async mode needs pip install 'posttune-grpo[ray]'")
    out = tmp_path / "run"
    run_python("-m", "posttune.cli.main", "train", "grpo-tiny-reverse", f"model.path={warm_start}",
               f"checkpoint.output_dir={out}", f"method.mode={mode}", timeout=1800)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = statistics.mean(r["reward"] for r in steps[:20])
    last = statistics.mean(r["reward"] for r in steps[-20:])
    assert last >= first + stated_number(CONFIG, "reward rise"), (first, last)
    assert (out / "model" / "config.json").is_file()
