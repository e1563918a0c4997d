"""The metric-logger hook: a tracker plugin is told the run's start, each metrics record and the end,
in order, on the main rank only; its names and options are checked before launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from posttune.plugin import MetricLogger, TrackerRun, flat_config, hookimpl, scalar_metrics
from tracking_support import metrics, tracked_config


@dataclass(frozen=True)
class RecorderOptions:
    label: str = "plain"  # a setting the recorder is told at start
    fail_at: str | None = None  # "start" / "log" / "finish": raise there


class Recorder:
    """A tracker plugin that keeps every call it receives, in order."""

    POSTTUNE_PLUGIN_API = 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, run: TrackerRun) -> str:
        self.calls.append(("start", run))
        if run.options.fail_at == "start":
            raise ConnectionError("no tracking server at http://nowhere:5000\nretried 3 times")
        return "handle"

    def log(self, handle: str, record: dict) -> None:
        assert handle == "handle"
        self.calls.append(("log", record))
        if self.calls[0][1].options.fail_at == "log":
            raise RuntimeError("quota exceeded")

    def finish(self, handle: str, summary: dict | None, artefacts: dict) -> None:
        self.calls.append(("finish", (summary, artefacts)))
        if self.calls[0][1].options.fail_at == "finish":
            raise RuntimeError("upload failed")

    @hookimpl
    def posttune_register_metric_loggers(self, register):
        register(MetricLogger("recorder", self.start, self.log, self.finish, config=RecorderOptions,
                              description="keeps what it is told"))


@pytest.fixture
def recorder(register_plugin) -> Recorder:
    plugin = Recorder()
    register_plugin(plugin, name="recorder", distribution="posttune-recorder", version="1.2")
    return plugin


def test_a_tracker_is_told_the_start_every_record_and_the_end_in_order(recorder, train, tmp_path):
    out = train(tracked_config(tmp_path, ["recorder"], {"recorder": {"label": "mine"}}))
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["start", "log", "log", "log", "finish"]
    run = recorder.calls[0][1]
    assert run.options == RecorderOptions(label="mine")
    assert run.config == yaml.safe_load((out / "config.yaml").read_text())  # the resolved config
    assert run.config["logging"] == ["recorder"] and run.config["method"] == {"name": "sft", "train_on_input": False,
                                                                          "packing": False, "long_samples": "truncate",
                                                                          "padding_free": True,
                                                                          "neftune_alpha": None, "loss_type": "nll"}
    assert (run.output_dir, run.name, run.resumed_step, run.total_steps) == (out, "out", None, 3)
    assert run.run_id == json.loads((out / "run.json").read_text())["run_id"]
    records = [record for kind, record in recorder.calls if kind == "log"]
    assert records == metrics(out)  # the very records of metrics.jsonl, the validation loss among them
    assert "val_loss" in records[1] and "val_loss" not in records[0]
    summary, artefacts = recorder.calls[-1][1]
    assert summary == json.loads((out / "summary.json").read_text())
    assert artefacts["model"] == out / "model" and (out / "model" / "config.json").is_file()
    assert {key: artefacts[key] for key in ("metrics", "summary", "config")} == {
        "metrics": out / "metrics.jsonl", "summary": out / "summary.json", "config": out / "config.yaml"}
    assert all(path.exists() for path in artefacts.values())


def test_a_resumed_run_tells_the_tracker_its_lineage_and_step(recorder, train, tmp_path):
    path = tracked_config(tmp_path, ["recorder"], steps=2, checkpoint={"save_every": 2})
    out = train(path)
    first = recorder.calls[0][1]
    recorder.calls.clear()
    train(path, "train.max_steps=3", "checkpoint.resume=latest")
    resumed = recorder.calls[0][1]
    assert (resumed.run_id, resumed.resumed_step, resumed.total_steps) == (first.run_id, 2, 3)
    assert [record["step"] for kind, record in recorder.calls if kind == "log"] == [3]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_a_tracker_that_fails_to_start_stops_the_run_in_one_line(recorder, llama_sft, posttune_cli, tmp_path):
    path = tracked_config(tmp_path, ["recorder"], {"recorder": {"fail_at": "start"}})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "posttune: error: logging: tracker 'recorder' (posttune-recorder 1.2) failed to start: "
        "ConnectionError: no tracking server at http://nowhere:5000")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no step ran
    assert [kind for kind, _ in recorder.calls] == ["start"]


def test_a_tracker_that_fails_later_is_dropped_with_one_warning_and_the_run_finishes(recorder, llama_sft,
                                                                                    posttune_cli, tmp_path):
    path = tracked_config(tmp_path, ["recorder"], {"recorder": {"fail_at": "log"}})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "recorder" in line]
    assert warnings == ["posttune: warning: logging: tracker 'recorder' (posttune-recorder 1.2) failed to log a "
                        "record and is dropped: RuntimeError: quota exceeded"]
    assert [kind for kind, _ in recorder.calls] == ["start", "log", "finish"]
    assert recorder.calls[-1][1] == (None, {})  # closed as stopped early
    assert len(metrics(tmp_path / "out")) == 3  # the run itself went on


def test_a_run_that_stops_with_an_error_closes_its_trackers_without_a_summary(recorder, llama_sft, posttune_cli,
                                                                              tmp_path):
    path = tracked_config(tmp_path, ["recorder"], train={"lr": 1e30})  # the loss overflows
    result = posttune_cli("train", str(path))
    assert result.exit_code == 2 and "posttune: error: train: step 2: the " in result.stderr
    assert [kind for kind, _ in recorder.calls] == ["start", "log", "finish"]
    assert recorder.calls[-1][1] == (None, {})


@pytest.mark.parametrize("logging, options, message", [
    (["recordr"], None, "config: logging[0]: no metric logger 'recordr' is installed (installed: recorder) "
                        "(did you mean 'recorder'?)"),
    (["wandbb"], None, "config: logging[0]: no metric logger 'wandbb' is installed (installed: recorder) "
                       "(did you mean 'wandb'?) — pip install posttune-wandb"),
    (["mlflow"], None, "config: logging[0]: no metric logger 'mlflow' is installed (installed: recorder) "
                       "— pip install posttune-mlflow"),
    (["recorder", "recorder"], None, "config: logging[1]: 'recorder' is listed twice"),
    (["recorder"], {"recorder": {"lable": "x"}}, "config: logging_options.recorder.lable: unknown key "
                                                 "(did you mean 'label'?)"),
    (["recorder"], {"recorder": {"label": 3}}, "config: logging_options.recorder.label: expected a string, got 3"),
    ([], {"recorder": {}}, "config: logging_options.recorder: 'recorder' is not in logging (listed: none)"),
    (["recorder"], {"recordr": {}}, "config: logging_options.recordr: 'recordr' is not in logging (listed: "
                                    "recorder) (did you mean 'recorder'?)"),
    ("recorder", None, "config: logging: expected a list, got 'recorder'"),
])
def test_validate_refuses_bad_logging_in_one_line(recorder, llama_sft, posttune_cli, tmp_path, logging, options,
                                                  message):
    result = posttune_cli("validate", str(tracked_config(tmp_path, logging, options)))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"posttune: error: {message}\n"


def test_ls_lists_trackers_and_config_keys_their_options(recorder, posttune_cli):
    listed = posttune_cli("ls", "loggers").stdout
    assert listed.splitlines() == ["recorder  posttune-recorder 1.2  keeps what it is told"]
    keys = posttune_cli("config", "keys", "logging_options").stdout
    assert "logging_options.recorder.label" in keys and "a setting the recorder is told at start" in keys


def test_scalar_metrics_keeps_the_numbers_and_flat_config_every_value():
    record = {"step": 3, "epoch": 0, "loss": 1.5, "skipped_nonfinite": "loss", "ok": True, "rewards/margin": 0.25}
    assert scalar_metrics(record) == {"epoch": 0.0, "loss": 1.5, "rewards/margin": 0.25}
    config = {"train": {"lr": 1e-3, "optimizer": "adamw", "max_steps": None}, "memory": [], "logging": ["wandb"],
              "parallel": {"options": {}}, "adapter": {"targets": ["q", "v"], "dropout": 0.0}}
    assert flat_config(config) == {"train.lr": 1e-3, "train.optimizer": "adamw", "train.max_steps": "null",
                                   "memory": "[]", "logging": '["wandb"]', "parallel.options": "{}",
                                   "adapter.targets": '["q", "v"]', "adapter.dropout": 0.0}


# ---- only the main rank logs (two processes under torchrun, gloo on CPU) --------------------------------

RECORDER_MODULE = '''
import json, os
from dataclasses import dataclass
from posttune.plugin import MetricLogger, hookimpl

POSTTUNE_PLUGIN_API = 2

def _write(run_dir, event, data):
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(run_dir, f"tracked-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps([event, data]) + "\\n")

def start(run):
    _write(run.output_dir, "start", run.resumed_step)
    return str(run.output_dir)

def log(run_dir, record):
    _write(run_dir, "log", record)

def finish(run_dir, summary, artefacts):
    _write(run_dir, "finish", summary)

@hookimpl
def posttune_register_metric_loggers(register):
    register(MetricLogger("filerecorder", start, log, finish))
'''


@pytest.mark.slow
def test_only_the_main_rank_runs_the_trackers(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "posttune_filerecorder.py").write_text(textwrap.dedent(RECORDER_MODULE))
    info = site / "posttune_filerecorder-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posttune-filerecorder\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[posttune]\nfilerecorder = posttune_filerecorder\n")
    path = tracked_config(tmp_path / "run", ["filerecorder"], parallel={"plans": ["fsdp2"]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(path), "--nproc-per-node", "2",
               "--standalone"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "world size 2" in result.stdout
    out = tmp_path / "run" / "out"
    assert sorted(p.name for p in out.glob("tracked-rank*.jsonl")) == ["tracked-rank0.jsonl"]
    events = [json.loads(line) for line in (out / "tracked-rank0.jsonl").read_text().splitlines()]
    assert [event for event, _ in events] == ["start", "log", "log", "log", "finish"]
    assert [data for event, data in events if event == "log"] == metrics(out)
    assert events[-1][1] == json.loads((out / "summary.json").read_text())
