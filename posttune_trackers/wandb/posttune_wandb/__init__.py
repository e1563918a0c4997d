"""posttune-wandb: a run's metrics, config and summary in Weights & Biases.

    logging: [wandb]
    logging_options:
      wandb: {project: my-project, mode: offline}   # offline: files only; `wandb sync` uploads them

What W&B receives (docs/trackers.md): the resolved config as the run's config (nested, as
config.yaml holds it); each metrics record's numbers at its ``step``; at the end summary.json's
values in the run summary as ``summary/<key>``, and config.yaml (as ``posttune_config.yaml``), summary.json,
metrics.jsonl and loss.png as run files (the final model or adapter as an artifact with ``log_model: true``).

The W&B run id is posttune's lineage id, with ``resume="allow"``: a resumed posttune run
continues the same W&B run. W&B drops history rows whose step is not above the last it holds,
so steps a killed run logged past its last checkpoint keep their first values there.

Importing this package does not import wandb (`posttune plugins` stays fast).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttune.plugin import MetricLogger, TrackerRun, hookimpl, scalar_metrics

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

#: files of a finished run saved with the W&B run (the model is an artifact, and only when asked): artefact -> the
#: name it gets there, None for its own. Not config.yaml: W&B writes the run's config under that name in the same
#: folder (wandb.sdk.lib.filenames.CONFIG_FNAME, one of its own files), so one would overwrite the other.
RUN_FILES = {"config": "posttune_config.yaml", "summary": None, "metrics": None, "plot": None}


@dataclass(frozen=True)
class WandbOptions:
    project: str = "posttune"  # the W&B project
    entity: str | None = None  # team or user; null: the logged-in user's default entity
    name: str | None = None  # the run's display name; null: the output directory's name
    # offline: write files only (`wandb sync` later); null: WANDB_MODE's, else online
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None  # where wandb writes its files; null: $WANDB_DIR if set, else the output directory
    group: str | None = None  # runs of one group are shown together (e.g. a sweep)
    tags: list[str] = field(default_factory=list)  # the run's tags
    notes: str | None = None  # a longer description of the run
    log_model: bool = False  # upload the final model or adapter as a W&B artifact (may be gigabytes)


@dataclass(frozen=True)
class Opened:
    """What ``start`` hands to ``log`` and ``finish``: the W&B run and the options it was opened with."""

    run: Any  # wandb.Run
    options: WandbOptions


def start(run: TrackerRun) -> Opened:
    import wandb

    options: WandbOptions = run.options
    directory = options.dir or (None if os.environ.get("WANDB_DIR") else str(run.output_dir))
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
    # The lineage id as the W&B id: a resumed posttune run continues its W&B run; allow_val_change
    # lets a resume's changed settings (a raised max_steps) replace the saved ones.
    mode = options.mode or os.environ.get("WANDB_MODE") or None  # read at each start (one process, several runs)
    wb = wandb.init(project=options.project, entity=options.entity, name=options.name or run.name,
                    mode=mode, dir=directory, group=options.group, tags=options.tags or None,
                    notes=options.notes, config=dict(run.config), allow_val_change=True,
                    id=run.run_id, resume="allow", reinit="create_new")
    return Opened(wb, options)


def log(opened: Opened, record: Mapping[str, Any]) -> None:
    opened.run.log(scalar_metrics(record), step=int(record["step"]))


def finish(opened: Opened, summary: Mapping[str, Any] | None, artefacts: Mapping[str, Path]) -> None:
    wb = opened.run
    if summary is not None:
        # Under summary/: W&B's summary also keeps each history key's last value (``tokens`` of the last
        # step), and at finish that would overwrite the run's own totals of the same name.
        wb.summary.update({f"summary/{key}": value for key, value in summary.items()})
        files = Path(wb.dir)  # absent when W&B is disabled (mode or WANDB_MODE): nothing to keep then
        for key, name in RUN_FILES.items():  # files in the run's directory are kept with the run (uploaded at finish)
            if key in artefacts and files.is_dir():
                shutil.copy2(artefacts[key], files / (name or artefacts[key].name))
        model = artefacts.get("adapter") or artefacts.get("model")
        if opened.options.log_model and model is not None and files.is_dir():
            import wandb

            artifact = wandb.Artifact(f"{wb.id}-{model.name}", type="model")
            artifact.add_dir(str(model))
            wb.log_artifact(artifact)
    wb.finish(exit_code=0 if summary is not None else 1)


@hookimpl
def posttune_register_metric_loggers(register: Any) -> None:
    register(MetricLogger("wandb", start, log, finish, config=WandbOptions,
                          description="Weights & Biases: metrics, config, summary and files (online or offline)"))
