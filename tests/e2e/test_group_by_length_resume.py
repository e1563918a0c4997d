"""A length-grouped run killed mid-epoch and resumed logs bitwise the same per-step losses as the
uninterrupted run: the grouped order is recomputed from (seed, epoch) and the consumed batches skipped."""

from __future__ import annotations

import pytest
import yaml
from kill_support import losses, run, together

# another sampler's resume beside tests/e2e/test_resume.py's: tox -e extended
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_sigkill_mid_epoch_then_resume_with_group_by_length_matches_the_uninterrupted_run(tmp_path, make_config):
    paths = {}
    for name in ("straight", "killed"):
        config = make_config(tmp_path, rows=40, data={"group_by_length": True, "pad_to_multiple_of": 8},
                             train={"epochs": 2, "lr": 3e-3}, checkpoint={"save_every": 3, "keep_last": 2})
        config["checkpoint"]["output_dir"] = str(tmp_path / name)
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 8)))  # last checkpoint: step 6
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    expected = losses(tmp_path / "straight")
    assert [step for step, _ in expected] == list(range(1, 21))
    assert losses(tmp_path / "killed") == expected  # bitwise: floats round-trip through JSON exactly
