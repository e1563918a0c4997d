"""posttune-wandb in offline mode: what a run logs, read back from the W&B run file with wandb's own
reader (`wandb leet inspect --json`, which prints the records of a .wandb transaction log)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import posttune_wandb
import pytest
import yaml
from tracking_support import metrics, series, tracked_config

OFFLINE = {"wandb": {"mode": "offline", "project": "reversal"}}


@pytest.fixture
def wandb_plugin(register_plugin, monkeypatch, tmp_path):
    for name in ("WANDB_DIR", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    register_plugin(posttune_wandb, distribution="posttune-wandb", version="0.1.0")


def run_dirs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's .wandb file, as wandb's own reader prints them."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                            capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def history(found: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    rows = [r["history"] for r in found if r["type"] == "history"]
    return [(int(row["step"]["num"]), row["item"][key]) for row in rows if key in row["item"]]


def summary(found: list[dict[str, Any]]) -> dict[str, Any]:
    latest: dict[str, Any] = {}
    for record in found:
        if record["type"] == "summary":
            latest.update(record["summary"].get("update", {}))
    return latest


def test_the_offline_run_holds_every_metric_the_config_and_the_summary(wandb_plugin, train, tmp_path):
    out = train(tracked_config(tmp_path, ["wandb"], OFFLINE))
    (run_dir,) = run_dirs(out)  # in the output directory by default
    found = records(run_dir)
    logged = metrics(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        assert history(found, key) == series(logged, key), key
    assert [step for step, _ in history(found, "loss")] == [1, 2, 3]
    (run,) = [r["run"] for r in found if r["type"] == "run"]
    lineage = json.loads((out / "run.json").read_text())["run_id"]
    assert (run["run_id"], run["project"], run["display_name"]) == (lineage, "reversal", "out")
    config = {key: value for key, value in run["config"]["update"].items() if key != "_wandb"}
    assert config == yaml.safe_load((out / "config.yaml").read_text())
    expected = json.loads((out / "summary.json").read_text())
    assert {key: summary(found)[f"summary/{key}"] for key in expected} == expected
    assert summary(found)["loss"] == logged[-1]["loss"]  # W&B's own: each history key's last value
    assert [r["exit"].get("exit_code", 0) for r in found if r["type"] == "exit"] == [0]
    kept = {"posttune_config.yaml": "config.yaml", "summary.json": "summary.json", "metrics.jsonl": "metrics.jsonl"}
    for name, written in kept.items():  # kept with the run's files; config.yaml is W&B's own name there
        assert (run_dir / "files" / name).read_bytes() == (out / written).read_bytes()
    assert not (run_dir / "files" / "config.yaml").exists()  # left to W&B, which writes the run's config there


def test_a_resumed_run_continues_the_same_wandb_run(wandb_plugin, train, tmp_path):
    path = tracked_config(tmp_path, ["wandb"], OFFLINE, steps=2, checkpoint={"save_every": 2})
    out = train(path)
    train(path, "train.max_steps=3", "checkpoint.resume=latest")
    first, second = (records(run_dir) for run_dir in run_dirs(out))
    ids = {r["run"]["run_id"] for found in (first, second) for r in found if r["type"] == "run"}
    assert ids == {json.loads((out / "run.json").read_text())["run_id"]}  # one W&B run, synced as one
    assert history(first, "loss") + history(second, "loss") == series(metrics(out), "loss")
    assert [step for step, _ in history(second, "loss")] == [3]


def test_online_mode_without_a_login_stops_the_run_in_one_line(wandb_plugin, llama_sft, posttune_cli, monkeypatch,
                                                               tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # no mode anywhere: W&B's default, online
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no stored login either
    result = posttune_cli("train", str(tracked_config(tmp_path, ["wandb"], {"wandb": {"project": "reversal"}})))
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "posttune: error: logging: tracker 'wandb' (posttune-wandb 0.1.0) failed to start: UsageError: No API key "
        "configured. Use `wandb login` to log in.")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_wandb_mode_from_the_environment_is_kept(wandb_plugin, llama_sft, posttune_cli, monkeypatch, tmp_path):
    """WANDB_MODE=offline, as clusters without egress export it, with no logging_options mode: offline files."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    result = posttune_cli("train", str(tracked_config(tmp_path, ["wandb"], {"wandb": {"project": "reversal"}})))
    assert result.exit_code == 0, result.stderr
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))


def test_disabled_mode_trains_and_writes_nothing_of_wandb(wandb_plugin, llama_sft, posttune_cli, tmp_path):
    result = posttune_cli("train", str(tracked_config(tmp_path, ["wandb"], {"wandb": {"mode": "disabled"}})))
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr
    assert not (tmp_path / "out" / "wandb").exists() and len(metrics(tmp_path / "out")) == 3


@pytest.mark.slow
def test_a_run_that_stops_on_an_error_exits_failed(wandb_plugin, llama_sft, posttune_cli, tmp_path):
    """A run stopped by the non-finite guard (``train.lr`` 1e30) ends with a non-zero exit code in the run file, which
    W&B shows as failed; a finished run's is 0."""
    path = tracked_config(tmp_path, ["wandb"], OFFLINE)
    result = posttune_cli("train", str(path), "train.lr=1e30")
    assert result.exit_code == 2 and "posttune: error: train: step 2: " in result.stderr, result.stderr
    out = Path(yaml.safe_load(path.read_text())["checkpoint"]["output_dir"])
    exits = [record["exit"] for record in records(run_dirs(out)[0]) if record["type"] == "exit"]
    assert [record.get("exit_code", 0) for record in exits] == [1], exits  # 0 is left out of the record
