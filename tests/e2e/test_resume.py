"""Exact resume: a run killed with SIGKILL (mid-epoch, or while writing a checkpoint) and resumed
logs the same per-step losses as the uninterrupted run, bitwise, on CPU fp32."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

#: Runs `posttune train CONFIG` after arranging for this very process to be SIGKILLed at a chosen
#: moment, so the kill lands at the same place every time (a timer could miss a 20-step run).
KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from posttune.cli.main import main
    import posttune.training.trainer as trainer

    mode, at = sys.argv[1], int(sys.argv[2])
    step = trainer._optimizer_step

    def kill_after_step(session, window, log):
        tokens = step(session, window, log)
        if session.step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return tokens

    real_save = torch.save
    saves = []

    def kill_while_saving(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        if str(path).endswith("optimizer.pt"):
            saves.append(path)
            if len(saves) == at:
                os.kill(os.getpid(), signal.SIGKILL)

    if mode == "step":
        trainer._optimizer_step = kill_after_step
    else:
        torch.save = kill_while_saving
    sys.exit(main(["train", *sys.argv[3:]]))
""")


def run(*args: str, killer: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    if killer is None:
        command = [sys.executable, "-m", "posttune.cli.main", "train", *args]
    else:
        command = [sys.executable, "-c", KILLER, killer[0], str(killer[1]), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def losses(output_dir: Path) -> list[tuple[int, float]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.fixture(params=["full", "lora"])
def configs(request, tmp_path, make_config):
    """Two configs over the same data: 40 rows, batch 4 -> 10 steps an epoch, 2 epochs, save every 3."""
    sections = {"train": {"epochs": 2, "lr": 3e-3}, "checkpoint": {"save_every": 3, "keep_last": 2}}
    if request.param == "lora":
        sections["adapter"] = {"rank": 4, "alpha": 8, "dropout": 0.1}  # dropout: the RNG state must resume too
    paths = {}
    for name in ("straight", "killed"):
        config = make_config(tmp_path, rows=40, **sections)
        config["checkpoint"]["output_dir"] = str(tmp_path / name)
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    return paths, tmp_path


def test_sigkill_mid_epoch_then_resume_matches_the_uninterrupted_run(configs):
    paths, root = configs
    straight = run(str(paths["straight"]))
    assert straight.returncode == 0, straight.stderr
    killed = run(str(paths["killed"]), killer=("step", 8))  # last checkpoint: step 6, mid-epoch 0
    assert killed.returncode == -9
    assert sorted(p.name for p in (root / "killed" / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    expected = losses(root / "straight")
    assert [s for s, _ in expected] == list(range(1, 21))
    assert losses(root / "killed") == expected  # bitwise: floats round-trip through JSON exactly


def test_kill_while_writing_a_checkpoint_leaves_the_previous_one_resumable(configs):
    paths, root = configs
    straight = run(str(paths["straight"]))
    assert straight.returncode == 0, straight.stderr
    killed = run(str(paths["killed"]), killer=("save", 2))  # dies inside the step-6 save
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
