"""Exact resume: a run killed with SIGKILL (mid-epoch, or while writing a checkpoint) and resumed
logs the same per-step losses as the uninterrupted run, bitwise, on CPU fp32."""

from __future__ import annotations

import json

import pytest
import yaml
from kill_support import losses, run, together

pytestmark = pytest.mark.slow


@pytest.fixture(params=["full", "lora"])
def configs(request, tmp_path, make_config):
    """Two configs over the same data: 40 rows, batch 4 -> 10 steps an epoch, 2 epochs, save every 3."""
    sections = {"train": {"epochs": 2, "lr": 3e-3}, "checkpoint": {"save_every": 3, "keep_last": 2}}
    if request.param == "lora":
        sections["adapter"] = {"rank": 4, "alpha": 8, "dropout": 0.1}  # dropout: the RNG state must resume too
    return twin_configs(tmp_path, make_config, 40, sections), tmp_path


def twin_configs(tmp_path, make_config, rows: int, sections: dict) -> dict:
    """The same run twice, ``straight`` and ``killed``, each with its own output directory: name -> config path."""
    paths = {}
    for name in ("straight", "killed"):
        config = make_config(tmp_path, rows=rows, **sections)
        config["checkpoint"]["output_dir"] = str(tmp_path / name)
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    return paths


def test_sigkill_mid_epoch_then_resume_matches_the_uninterrupted_run(configs):
    paths, root = configs
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 8)))  # last checkpoint: step 6
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    assert sorted(p.name for p in (root / "killed" / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    expected = losses(root / "straight")
    assert [s for s, _ in expected] == list(range(1, 21))
    assert losses(root / "killed") == expected  # bitwise: floats round-trip through JSON exactly


# a save is as atomic with adapters as without: tox -e extended runs the LoRA case too
@pytest.mark.parametrize("configs", ["full", pytest.param("lora", marks=pytest.mark.extended)], indirect=True)
def test_kill_while_writing_a_checkpoint_leaves_the_previous_one_resumable(configs):
    paths, root = configs
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("save", 2)))  # dies inside the step-6 save
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    checkpoints = root / "killed" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir() if not p.name.startswith(".")] == ["step-00000003"]
    assert any(p.name.startswith(".step-00000006.tmp-") for p in checkpoints.iterdir())  # the torn write
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(root / "killed") == losses(root / "straight")
    assert not any(p.name.startswith(".") for p in checkpoints.iterdir())  # stale temp dirs cleaned up


def test_resume_from_a_path_that_is_not_a_checkpoint_is_one_line(tmp_path, make_config):
    config = make_config(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run(str(path), f"checkpoint.resume={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().endswith(f"checkpoint.resume: {tmp_path} is not a posttune checkpoint "
                                          "(no trainer_state.json)")


def test_a_checkpoint_at_an_epoch_ending_in_a_partial_step_resumes_the_next_epoch(tmp_path, make_config):
    """26 rows, batch 2 x accumulation 3: 13 micro-batches, 5 steps an epoch, the last partial. Its checkpoint was
    written after the loader had moved to the next epoch: resumed, epoch 1 was logged as 0 and trained twice, and
    the last epoch's data never."""
    sections = {"train": {"epochs": 3, "batch_size": 2, "grad_accum_steps": 3, "lr": 3e-3},
                "checkpoint": {"save_every": "epoch", "keep_last": 5}}
    paths = twin_configs(tmp_path, make_config, 26, sections)
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 7)))  # last checkpoint: step 5
    assert (straight.returncode, killed.returncode) == (0, -9), straight.stderr
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in records] == [(s, (s - 1) // 5) for s in range(1, 16)]
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
