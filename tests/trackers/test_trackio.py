"""posttune-trackio, offline: what a run logs, read back with Trackio's own storage reader.

Trackio fixes its storage folder ($TRACKIO_DIR) when it is imported, so the run and the reader
each go in a subprocess with their own TRACKIO_DIR (entry points load the installed plugins).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tracking_support import metrics, series, tracked_config

READ = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
runs = SQLiteStorage.get_runs(project)
print(json.dumps({run: {"logs": SQLiteStorage.get_logs(project, run),
                        "config": SQLiteStorage.get_run_config(project, run)} for run in runs}))
"""


def environment(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "POSTTUNE_LOAD_PLUGINS": "posttune-llama,posttune-sft,posttune-trackio"}


def train(path: Path, tmp_path: Path, *overrides: str) -> Path:
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(path), *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    return Path(yaml.safe_load(path.read_text())["checkpoint"]["output_dir"])


def stored(tmp_path: Path, project: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", READ, project], capture_output=True, text=True, timeout=120,
                            env=environment(tmp_path), check=True)
    return json.loads(result.stdout)


def logged(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if key in row]


@pytest.mark.slow
def test_the_local_store_holds_every_metric_the_config_and_the_summary(tmp_path):
    out = train(tracked_config(tmp_path, ["trackio"], {"trackio": {"project": "reversal"}}), tmp_path)
    lineage = json.loads((out / "run.json").read_text())["run_id"]
    runs = stored(tmp_path, "reversal")
    assert list(runs) == [f"out-{lineage}"]
    rows, config = runs[f"out-{lineage}"]["logs"], runs[f"out-{lineage}"]["config"]
    records = metrics(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        assert logged(rows, key) == series(records, key), key
    assert [step for step, _ in logged(rows, "loss")] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert logged(rows, "summary/val_loss") == [(3, summary["val_loss"])]
    assert {key: value for key, value in config.items() if not key.startswith("_")} == \
        yaml.safe_load((out / "config.yaml").read_text())


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_trackio_run(tmp_path):
    path = tracked_config(tmp_path, ["trackio"], {"trackio": {"project": "reversal"}}, steps=2,
                          checkpoint={"save_every": 2})
    out = train(path, tmp_path)
    train(path, tmp_path, "train.max_steps=3", "checkpoint.resume=latest")
    runs = stored(tmp_path, "reversal")
    assert len(runs) == 1  # one Trackio run for the whole lineage
    (only,) = runs.values()
    assert logged(only["logs"], "loss") == series(metrics(out), "loss")


TRACK = """
from pathlib import Path
import posttune_trackio as tracker
from posttune.plugin import TrackerRun
run = TrackerRun("out", Path("out"), {"train": {"lr": 0.1}}, tracker.TrackioOptions(project="once"), "lineage", None, 1)
tracked = tracker.start(run)
tracker.log(tracked, {"step": 1, "loss": 1.5})
tracker.finish(tracked, {"final_step": 1, "loss": 1.5}, {})
"""


def test_a_run_is_finished_once(tmp_path):
    """finish() ends trackio's current run, so trackio's own atexit hook does not finish it again: one
    "Run finished" line per run, not two, and what was logged is stored."""
    result = subprocess.run([sys.executable, "-c", TRACK], capture_output=True, text=True, timeout=120,
                            env=environment(tmp_path), check=True)
    assert result.stdout.count("* Run finished.") == 1, result.stdout
    assert logged(stored(tmp_path, "once")["out-lineage"]["logs"], "loss") == [(1, 1.5)]
