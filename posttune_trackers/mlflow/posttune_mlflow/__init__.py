"""posttune-mlflow: a run's metrics, parameters and files in MLflow.

    logging: [mlflow]
    logging_options:
      mlflow: {tracking_uri: http://mlflow.internal:5000, experiment: reversal}

What MLflow receives (docs/trackers.md): at the start the flattened config as run parameters
(``train.lr``, ``method.beta``, ...) and the tag ``posttune.run_id``; each metrics record's
numbers as metrics at its ``step``; at the end the summary's numbers as ``summary/<key>`` metrics
and config.yaml, summary.json, metrics.jsonl and loss.png as artifacts (the final model or adapter
too with ``log_model: true``), and the run's status (FINISHED, or KILLED when it stopped early).

Without a ``tracking_uri`` (and no ``MLFLOW_TRACKING_URI``) the run goes to a local store inside
the output directory, ``sqlite:///OUTPUT/mlflow.db`` with artifacts in OUTPUT/mlartifacts
(MLflow 3 refuses new plain-file stores): `mlflow ui --backend-store-uri sqlite:///OUTPUT/mlflow.db`.
A resumed posttune run finds its MLflow run by the ``posttune.run_id`` tag and continues it;
parameters keep their first values (MLflow parameters cannot change), and steps a killed run
logged past its last checkpoint stay in the metric history beside the re-run ones.

Importing this package does not import mlflow. It uses ``MlflowClient`` only (no global active
run), so it never disturbs a run the calling code has open.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttune.plugin import MetricLogger, TrackerRun, flat_config, hookimpl, scalar_metrics

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

LINEAGE_TAG = "posttune.run_id"
#: files of a finished run logged as artifacts (the model only with ``log_model``)
RUN_FILES = ("config", "summary", "metrics", "plot")
#: MLflow's limits: characters of a parameter value, and entries of one ``log_batch``
MAX_PARAM_CHARS, BATCH = 6000, 100
#: the first request to a tracking server: retries and seconds to wait for an answer (`_impatient`)
START_RETRIES, START_TIMEOUT = 1, 15


@dataclass(frozen=True)
class MLflowOptions:
    #: the tracking server or store; null: $MLFLOW_TRACKING_URI if set, else sqlite:///OUTPUT/mlflow.db
    tracking_uri: str | None = None
    experiment: str = "posttune"  # the experiment's name; created when missing
    run_name: str | None = None  # the run's name; null: the output directory's name
    tags: dict[str, str] = field(default_factory=dict)  # extra run tags
    log_artifacts: bool = True  # log config.yaml, summary.json, metrics.jsonl and loss.png as artifacts
    log_model: bool = False  # also log the final model or adapter directory (may be gigabytes)


@dataclass(frozen=True)
class Opened:
    """What ``start`` hands to ``log`` and ``finish``."""

    client: Any  # mlflow.tracking.MlflowClient
    run_id: str  # MLflow's run id (not posttune's lineage id)
    options: MLflowOptions


def local_store(output_dir: Path) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def start(run: TrackerRun) -> Opened:
    from mlflow.tracking import MlflowClient

    options: MLflowOptions = run.options
    uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    local = uri is None
    client = MlflowClient(local_store(run.output_dir) if local else uri)
    with _impatient():  # the first request: a server that does not answer fails the start, not hangs it
        experiment = client.get_experiment_by_name(options.experiment)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        artifacts = (Path(run.output_dir).resolve() / "mlartifacts").as_uri() if local else None
        experiment_id = client.create_experiment(options.experiment, artifact_location=artifacts)
    found = _resumed_run(client, experiment_id, run) if run.resumed_step is not None else None
    if found is None:
        created = client.create_run(experiment_id, run_name=options.run_name or run.name,
                                    tags={**options.tags, LINEAGE_TAG: run.run_id})
        run_id, logged = created.info.run_id, {}
    else:
        run_id, logged = found.info.run_id, dict(found.data.params)
        client.update_run(run_id, status="RUNNING")
    params = {key: value for key, value in _params(run.config).items() if key not in logged}
    _log_params(client, run_id, params)
    return Opened(client, run_id, options)


@contextmanager
def _impatient() -> Iterator[None]:
    """MLflow's HTTP retries, capped for the duration (unless the user set them): by default it retries a refused
    connection 7 times with a doubling backoff, minutes of silence before the start fails (docs/trackers.md says
    an unreachable server stops the run before its first step, in one line). Later requests keep MLflow's
    patience: a server that answered once and then blinks should not stop a run."""
    limits = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(START_RETRIES), "MLFLOW_HTTP_REQUEST_TIMEOUT": str(START_TIMEOUT)}
    chosen = {key: value for key, value in limits.items() if key not in os.environ}
    os.environ.update(chosen)
    try:
        yield
    finally:
        for key in chosen:
            os.environ.pop(key, None)


def _resumed_run(client: Any, experiment_id: str, run: TrackerRun) -> Any:
    """The MLflow run of this lineage (the newest, should there be several), or None."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{LINEAGE_TAG}` = '{run.run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def _params(config: Mapping[str, Any]) -> dict[str, str]:
    """The flattened config as MLflow parameters: keys in MLflow's character set, values as text
    within its length limit."""
    params = {}
    for key, value in flat_config(config).items():
        text = json.dumps(value) if isinstance(value, bool) else str(value)  # true/false, as in the YAML
        if len(text) > MAX_PARAM_CHARS:
            text = text[:MAX_PARAM_CHARS - 3] + "..."
        params[re.sub(r"[^\w\-. /:]", "_", key)] = text
    return params


def _log_params(client: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in params.items()]
    for first in range(0, len(items), BATCH):
        client.log_batch(run_id, params=items[first:first + BATCH])


def _log_metrics(opened: Opened, values: Mapping[str, float], step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, step) for key, value in values.items()]
    for first in range(0, len(metrics), BATCH):
        opened.client.log_batch(opened.run_id, metrics=metrics[first:first + BATCH])


def log(opened: Opened, record: Mapping[str, Any]) -> None:
    _log_metrics(opened, scalar_metrics(record), int(record["step"]))


def finish(opened: Opened, summary: Mapping[str, Any] | None, artefacts: Mapping[str, Path]) -> None:
    client, run_id = opened.client, opened.run_id
    if summary is not None:
        numbers = scalar_metrics(summary)
        _log_metrics(opened, {f"summary/{key}": value for key, value in numbers.items()},
                     int(summary.get("final_step", 0)))
        if opened.options.log_artifacts:
            for key in RUN_FILES:
                if key in artefacts:
                    client.log_artifact(run_id, str(artefacts[key]))
        model = artefacts.get("adapter") or artefacts.get("model")
        if opened.options.log_model and model is not None:
            client.log_artifacts(run_id, str(model), artifact_path=model.name)
    client.set_terminated(run_id, status="FINISHED" if summary is not None else "KILLED")


@hookimpl
def posttune_register_metric_loggers(register: Any) -> None:
    register(MetricLogger("mlflow", start, log, finish, config=MLflowOptions,
                          description="MLflow: metrics, parameters and artifacts (a local store in OUTPUT by default)"))
