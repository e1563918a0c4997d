"""posttune-mlflow: what a run logs, read back with MLflow's own client from the local store in OUTPUT."""

from __future__ import annotations

import json
from pathlib import Path

import posttune_mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient
from tracking_support import metrics, series, tracked_config


@pytest.fixture
def mlflow_plugin(register_plugin, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default: a store in the output directory
    register_plugin(posttune_mlflow, distribution="posttune-mlflow", version="0.1.0")


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def only_run(client: MlflowClient) -> object:
    experiment = client.get_experiment_by_name("reversal")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return runs[0]


@pytest.mark.slow
def test_the_local_store_holds_every_metric_params_and_files_of_the_run(mlflow_plugin, train, tmp_path):
    options = {"mlflow": {"experiment": "reversal", "tags": {"team": "posttune"}}}
    out = train(tracked_config(tmp_path, ["mlflow"], options))
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = only_run(client)
    records = metrics(out)
    for key in ("loss", "lr", "grad_norm", "labelled_tokens", "val_loss"):
        assert history(client, run.info.run_id, key) == series(records, key), key
    assert [step for step, _ in history(client, run.info.run_id, "loss")] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert history(client, run.info.run_id, "summary/val_loss") == [(3, summary["val_loss"])]
    params = run.data.params
    assert (params["train.lr"], params["method.name"], params["train.max_steps"]) == ("0.001", "sft", "3")
    assert params["logging"] == '["mlflow"]' and params["adapter"] == "null"
    assert run.data.tags["posttune.run_id"] == json.loads((out / "run.json").read_text())["run_id"]
    assert (run.data.tags["team"], run.info.run_name, run.info.status) == ("posttune", "out", "FINISHED")
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "summary.json", "metrics.jsonl"} <= artifacts
    stored = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "downloaded")))
    assert json.loads(stored.read_text()) == summary
    assert (out / "mlartifacts").is_dir()  # artifacts stay in the output directory too


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_mlflow_run(mlflow_plugin, train, tmp_path):
    options = {"mlflow": {"experiment": "reversal"}}
    path = tracked_config(tmp_path, ["mlflow"], options, steps=2, checkpoint={"save_every": 2})
    out = train(path)
    train(path, "train.max_steps=3", "checkpoint.resume=latest")
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = only_run(client)  # one MLflow run for the whole lineage
    assert history(client, run.info.run_id, "loss") == series(metrics(out), "loss")
    assert [step for step, _ in history(client, run.info.run_id, "loss")] == [1, 2, 3]
    assert run.data.params["train.max_steps"] == "2"  # MLflow parameters keep their first value
    assert run.info.status == "FINISHED"


def test_a_server_that_refuses_connections_stops_the_start_in_seconds(mlflow_plugin, llama_sft, posttune_cli,
                                                                      tmp_path, monkeypatch):
    """MLflow retries a refused connection 7 times with a doubling backoff: the run sat silent for minutes. The
    first request is capped (the user's own MLFLOW_HTTP_REQUEST_* settings win), and the variables are restored."""
    import os
    import socket
    import time

    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = tracked_config(tmp_path, ["mlflow"], {"mlflow": {"tracking_uri": f"http://127.0.0.1:{port}"}})
    began = time.monotonic()
    result = posttune_cli("train", str(path))
    assert time.monotonic() - began < 60
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("posttune: error: logging: tracker 'mlflow' (posttune-mlflow 0.1.0) failed to "
                                    "start: MlflowException: API request to ")
    assert "Connection refused" in result.stderr
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


@pytest.mark.slow
def test_a_run_that_stops_on_an_error_ends_killed_not_finished(mlflow_plugin, llama_sft, posttune_cli, tmp_path):
    """A run stopped by the non-finite guard (``train.lr`` 1e30: step 2's gradients overflow) is no success in
    MLflow's own store: its status is KILLED, as for any run that did not finish."""
    path = tracked_config(tmp_path, ["mlflow"], {"mlflow": {"experiment": "reversal"}})
    result = posttune_cli("train", str(path), "train.lr=1e30")
    assert result.exit_code == 2 and "posttune: error: train: step 2: " in result.stderr, result.stderr
    out = Path(yaml.safe_load(path.read_text())["checkpoint"]["output_dir"])
    assert only_run(MlflowClient(f"sqlite:///{out / 'mlflow.db'}")).info.status == "KILLED"
