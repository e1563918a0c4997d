"""Distillation resumes exactly: SIGKILL mid-run, `resume: latest`, and the per-step losses are bitwise
those of the uninterrupted run -- off-policy, and on-policy (GKD) where which batches the student
samples itself, and what it samples, must come out the same after the restart."""

from __future__ import annotations

import json

import pytest
import yaml
from kill_support import run, together
from run_support import kd_config, save_hf_teacher

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("on_policy_fraction", [0.0, 0.5], ids=["off_policy", "on_policy"])
def test_sigkill_then_resume_gives_the_same_distillation_steps(tmp_path, on_policy_fraction):
    teacher = save_hf_teacher(tmp_path / "teacher")
    paths = {}
    for name in ("straight", "killed"):
        config = kd_config(tmp_path / name, teacher, rows=24,
                           method={"on_policy_fraction": on_policy_fraction, "max_new_tokens": 6},
                           train={"max_steps": 8, "grad_accum_steps": 2, "lr": 3e-3},
                           checkpoint={"save_every": 3, "keep_last": 2})
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 5)))
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr

    def curve(name: str) -> list[tuple]:
        lines = (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["divergence"], r["on_policy"], r["grad_norm"]) for r in map(json.loads, lines)]

    expected = curve("straight")
    assert [step for step, *_ in expected] == list(range(1, 9))
    on_policy_share = sum(r[3] for r in expected) / len(expected)
    assert (on_policy_share == 0) if on_policy_fraction == 0 else (0 < on_policy_share < 1)
    assert curve("killed") == expected
