"""posttune-trackio: a run's metrics and config in Trackio (local-first, W&B-like API).

    logging: [trackio]
    logging_options:
      trackio: {project: reversal}            # `trackio show --project reversal` opens the dashboard

What Trackio receives (docs/trackers.md): the resolved config as the run's config; each metrics
record's numbers at its ``step``; at the end the summary's numbers as one last log at the final
step, under ``summary/<key>``. Trackio writes to a local SQLite database per project in
``$TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``) and needs no network unless
``space_id`` names a Hugging Face Space to sync to.

Trackio resumes runs by name: the default name is the output directory's name and posttune's
lineage id, so a resumed posttune run continues its Trackio run (``resume="allow"``).

Importing this package does not import trackio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttune.plugin import MetricLogger, TrackerRun, hookimpl, scalar_metrics

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"


@dataclass(frozen=True)
class TrackioOptions:
    project: str = "posttune"  # the Trackio project (one SQLite database in $TRACKIO_DIR)
    name: str | None = None  # the run's name, which a resume continues; null: OUTPUT's name and the lineage id
    group: str | None = None  # runs of one group are shown together
    space_id: str | None = None  # a Hugging Face Space to sync to (needs network and a token); null: local only
    system_metrics: bool = False  # also log CPU/GPU usage every 10 s from a background thread


def run_name(run: TrackerRun) -> str:
    """The default run name: readable, and unique to the lineage so a resume finds it again."""
    return f"{run.name}-{run.run_id}"


def start(run: TrackerRun) -> Any:
    import trackio

    options: TrackioOptions = run.options
    return trackio.init(project=options.project, name=options.name or run_name(run), group=options.group,
                        space_id=options.space_id, config=dict(run.config), resume="allow",
                        auto_log_cpu=options.system_metrics, auto_log_gpu=options.system_metrics)


def log(tracked: Any, record: Mapping[str, Any]) -> None:
    tracked.log(scalar_metrics(record), step=int(record["step"]))


def finish(tracked: Any, summary: Mapping[str, Any] | None, artefacts: Mapping[str, Path]) -> None:
    if summary is not None:
        numbers = {f"summary/{key}": value for key, value in scalar_metrics(summary).items()}
        tracked.log(numbers, step=int(summary.get("final_step", 0)))
    import trackio

    # trackio.finish(), not the run's own finish(): it also clears trackio's current run, which trackio's atexit
    # hook would otherwise finish a second time (a second "* Run finished. Uploading logs ..." line)
    if trackio.context_vars.current_run.get() is tracked:
        trackio.finish()
    else:  # no longer trackio's current run (another init since): nothing left for its atexit hook to finish
        tracked.finish()


@hookimpl
def posttune_register_metric_loggers(register: Any) -> None:
    register(MetricLogger("trackio", start, log, finish, config=TrackioOptions,
                          description="Trackio: local-first metrics and config (SQLite), optional Space sync"))
