"""Sync GRPO resumes exactly: SIGKILL mid-run, `resume: latest` from a checkpoint that fell between two
micro-batches of one generation batch, and the per-step losses and rewards are bitwise those of the
uninterrupted run (the rollouts not yet trained on are part of the checkpoint)."""

from __future__ import annotations

import json

import pytest
import yaml
from kill_support import run, together
from run_support import grpo_config

pytestmark = pytest.mark.slow

#: a reward every random model earns unevenly (installed with posttune-grpo: `format` with a pattern)
ANY_VOWEL = {"name": "format", "options": {"pattern": ".*[AEIOU].*"}}


@pytest.mark.parametrize("method", [{}, {"beta": 0.04, "sync_reference_every": 2, "sync_reference_alpha": 0.5}],
                         ids=["plain", "synced_reference"])
def test_sigkill_then_resume_gives_the_same_grpo_steps(tmp_path, method):
    """With a synced reference (``sync_reference_every``), the one synced at step 2 resumes from step 3's
    checkpoint."""
    paths = {}
    for name in ("straight", "killed"):
        config = grpo_config(tmp_path / name, rows=8,
                             method={"rewards": [ANY_VOWEL], "num_iterations": 2, "micro_batch_size": 4, **method},
                             train={"max_steps": 8, "grad_accum_steps": 2, "lr": 5e-3},
                             checkpoint={"save_every": 3, "keep_last": 2})
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 5)))  # last checkpoint: step 3,
    assert straight.returncode == 0, straight.stderr  # half-way through a batch
    assert killed.returncode == -9
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr

    def curve(name: str) -> list[tuple]:
        lines = (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["reward"], r["grad_norm"]) for r in map(json.loads, lines)]

    expected = curve("straight")
    assert [step for step, *_ in expected] == list(range(1, 9))
    assert any(loss != 0 for _, loss, _, _ in expected)
    assert curve("killed") == expected
