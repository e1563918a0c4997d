"""KTO resumes exactly: SIGKILL mid-epoch, `resume: latest`, and the per-step losses, the reference point and
the reward metrics are bitwise those of the uninterrupted run (the feedback rows' labels travel in the loader's
resumable store, the mismatched pairs are made per batch)."""

from __future__ import annotations

import json

import pytest
import yaml
from kill_support import run, together
from run_support import kto_config

pytestmark = pytest.mark.slow


def test_sigkill_mid_epoch_then_resume_gives_the_same_kto_losses(tmp_path):
    paths = {}
    for name in ("straight", "killed"):
        config = kto_config(tmp_path / name, prompts=12, train={"epochs": 2, "lr": 3e-3},
                            checkpoint={"save_every": 2, "keep_last": 2})
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 5)))  # last checkpoint: step 4
    assert straight.returncode == 0, straight.stderr  # mid-epoch 0 (6 steps each)
    assert killed.returncode == -9
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr

    def curve(name: str) -> list[tuple]:
        records = [json.loads(line) for line in (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["kl"], r["rewards/chosen"], r["rewards/rejected"]) for r in records]

    expected = curve("straight")
    assert [step for step, *_ in expected] == list(range(1, 13))
    assert any(kl > 0 for _, _, kl, *_ in expected)  # the reference point moved off 0 at some step
    killed_curve = curve("killed")
    assert killed_curve[:4] == expected[:4], ("two fresh runs differed before the kill: this machine does not round "
                                             "alike run to run (docs/training.md, resume), not a resume defect")
    assert killed_curve == expected
