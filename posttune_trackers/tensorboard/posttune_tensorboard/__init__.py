"""posttune-tensorboard: a run's metrics as TensorBoard event files.

    logging: [tensorboard]          # events in OUTPUT/tensorboard; `tensorboard --logdir OUTPUT/tensorboard`

What TensorBoard receives (docs/trackers.md): at the start the flattened config as
hyper-parameters (the HParams tab, with ``loss`` and ``val_loss`` as its metrics) and as a YAML
text; each metrics record's numbers as scalars at its ``step`` (``rewards/chosen`` groups under
``rewards``); at the end the summary as text. Written with PyTorch's
``torch.utils.tensorboard.SummaryWriter``; everything stays local.

A resumed run appends to the same log directory with ``purge_step`` set past the resumed step,
so TensorBoard hides the events a killed run wrote after its last checkpoint; a fresh run in a
reused directory (``checkpoint.overwrite``) hides all the earlier ones the same way.

Importing this package does not import torch or tensorboard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttune.plugin import MetricLogger, TrackerRun, flat_config, hookimpl, scalar_metrics

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

#: the HParams tab's metrics: scalars the run logs under these tags
HPARAM_METRICS = ("loss", "val_loss")


@dataclass(frozen=True)
class TensorBoardOptions:
    log_dir: str | None = None  # where event files go; null: OUTPUT/tensorboard
    hparams: bool = True  # record the flattened config as hyper-parameters (the HParams tab)
    flush_secs: int = 30  # seconds between flushes to disk (and always at the end)


def start(run: TrackerRun) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    options: TensorBoardOptions = run.options
    log_dir = Path(options.log_dir) if options.log_dir else Path(run.output_dir) / "tensorboard"
    # purge_step: TensorBoard hides this directory's earlier events at or past it: those a killed run
    # wrote after its last checkpoint, or all of them when a fresh run reuses the directory (overwrite)
    purge = run.resumed_step + 1 if run.resumed_step is not None else 0
    first = run.resumed_step is None or not any(log_dir.glob("events.out.tfevents.*"))
    writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge, flush_secs=options.flush_secs)
    if first:  # a resume keeps the first session's hyper-parameters and config text
        if options.hparams:
            _write_hparams(writer, flat_config(run.config))
        writer.add_text("config", _as_code(run.config), global_step=0)
    return writer


def _write_hparams(writer: Any, hparams: dict[str, Any]) -> None:
    """The HParams plugin's three summaries in the run's own event file (``add_hparams`` would
    open a second run directory for them)."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    for summary in hparams_summaries(hparams, dict.fromkeys(HPARAM_METRICS, 0.0)):
        writer.file_writer.add_summary(summary)


def _as_code(data: Mapping[str, Any]) -> str:
    """YAML indented four spaces: TensorBoard renders text as Markdown, and this keeps it verbatim."""
    import yaml

    text = yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True)
    return "\n".join("    " + line for line in text.splitlines())


def log(writer: Any, record: Mapping[str, Any]) -> None:
    step = int(record["step"])
    for key, value in scalar_metrics(record).items():
        writer.add_scalar(key, value, global_step=step)


def finish(writer: Any, summary: Mapping[str, Any] | None, artefacts: Mapping[str, Path]) -> None:
    if summary is not None:
        writer.add_text("summary", _as_code(summary), global_step=int(summary.get("final_step", 0)))
    writer.close()


@hookimpl
def posttune_register_metric_loggers(register: Any) -> None:
    register(MetricLogger("tensorboard", start, log, finish, config=TensorBoardOptions,
                          description="TensorBoard event files: scalars, hyper-parameters, config and summary"))
