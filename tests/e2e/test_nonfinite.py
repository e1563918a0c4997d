"""The non-finite guard: a NaN/Inf loss or gradient norm stops the run at that step in one line
(exit 2) without saving it, or is skipped `train.skip_nonfinite` times; weights an infinite
learning rate made NaN or Inf are never written over a good model."""

from __future__ import annotations

import json

import pytest
import yaml
from fault_support import error_line, train, tree_digest

pytestmark = pytest.mark.slow


@pytest.fixture
def config(tmp_path, make_config):
    """6 steps (24 rows, batch 4), a checkpoint after every step, all kept."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config(tmp_path, train={"device": "cpu"},
                                               checkpoint={"save_every": 1, "keep_last": 10})))
    return path, tmp_path / "out"


def steps_saved(out) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else []


def test_a_nan_loss_stops_the_run_at_that_step_without_saving_it(config):
    path, out = config
    result = train(str(path), fault=("nan_loss", 3))
    assert result.returncode == 2
    assert error_line(result) == ("posttune: error: train: step 3: the loss is nan; stopped (train.skip_nonfinite lets "
                                  "a run skip such steps), without saving this step: the last checkpoint is the last "
                                  "good state")
    assert steps_saved(out) == [1, 2] and not (out / "model").exists()


def test_an_infinite_gradient_is_skipped_within_the_allowance(config):
    path, out = config
    result = train(str(path), "train.skip_nonfinite=1", fault=("inf_grad", 2))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["skipped_nonfinite"] == 1
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert records[2] == {"step": 2, "epoch": 0, "lr": 1e-3, "skipped_nonfinite": "grad norm"}
    weights = [tree_digest(out / "checkpoints" / f"step-{s:08d}" / "model")["model.safetensors"] for s in (1, 2)]
    assert weights[0] == weights[1]  # the skipped step left the weights alone


def test_past_the_allowance_the_run_stops_naming_the_step(config):
    path, out = config
    result = train(str(path), "train.skip_nonfinite=1", fault=("inf_grad_twice", 2))
    assert result.returncode == 2
    assert error_line(result).startswith("posttune: error: train: step 3: the grad norm is inf; stopped after "
                                         "skipping 1 such step(s) (train.skip_nonfinite: 1)")
    assert steps_saved(out) == [1, 2]


def test_a_diverging_run_never_writes_over_a_good_model(config):
    path, out = config
    assert train(str(path), "train.max_steps=2").returncode == 0
    good = tree_digest(out / "model")
    diverged = train(str(path), "checkpoint.overwrite=true", "train.lr=1e30")  # finite, but the weights overflow
    assert diverged.returncode == 2
    assert error_line(diverged).startswith("posttune: error: train: step 2: the ")
    poisoned = train(str(path), "checkpoint.overwrite=true", fault=("nan_weight", 2))
    assert poisoned.returncode == 2
    assert error_line(poisoned) == ("posttune: error: train: step 2: the trained weights hold NaN or Inf (is train.lr "
                                    f"too large?); stopped before writing checkpoint {out}/checkpoints/step-00000002, "
                                    "which would hold them")
    assert steps_saved(out) == [1] and tree_digest(out / "model") == good
