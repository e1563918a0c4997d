"""Experiment trackers in a run (docs/trackers.md): `logging:` resolved before launch, then the
trackers started, fed and finished on the main rank.

Resolution mirrors memory techniques: every name in ``logging`` must be an installed
``MetricLogger`` (an unknown one gets a "did you mean" and its `pip install` line), and
``logging_options.<name>`` is validated against that logger's ``config`` dataclass, so
`posttune validate` refuses a misspelt tracker or option in a second. At run time a tracker that
fails to start stops the run before step one with one line naming it; one that fails later is
reported once and dropped, so a flaky dashboard never costs a training run.

This module does not import torch: `posttune validate` resolves trackers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttune.config.typed import check_plugin_options, plugin_configs
from posttune.descriptors import MetricLogger, TrackerRun
from posttune.errors import ConfigError, PosttuneError, UnknownNameError, first_line
from posttune.registry import Registered, Registry

KIND = "metric_logger"


# ---- before launch: names and options --------------------------------------------------------------

def resolve(config: Any, registry: Registry) -> tuple[list[Registered], dict[str, Any]]:
    """The loggers ``config.logging`` names, in order, and each one's validated options (defaults if
    absent); every problem is a ConfigError naming the field."""
    loggers = []
    for index, name in enumerate(config.logging):
        try:
            loggers.append(registry.lookup(KIND, name))
        except UnknownNameError as exc:
            raise ConfigError(f"logging[{index}]", str(exc)) from None
    active = {item.descriptor.name: item for item in loggers}
    check_plugin_options(config.logging_options, active, "logging_options", "logging", "tracker")
    return loggers, plugin_configs(active, config.logging_options, "logging_options")


# ---- helpers for tracker plugins -------------------------------------------------------------------

def scalar_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record, ``step`` left out (trackers take it as the x axis): text such
    as a skipped step's ``skipped_nonfinite`` reason is dropped, NaN and Inf are kept as logged."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def flat_config(config: Mapping[str, Any], sep: str = ".") -> dict[str, str | int | float | bool]:
    """A nested config as one level of hyper-parameters (``{"train.lr": 1e-4, ...}``), what trackers'
    hyper-parameter tables take: numbers, text and booleans as they are; lists, empty mappings and
    null as JSON text, so every value is shown and none is lost."""
    flat: dict[str, str | int | float | bool] = {}

    def add(value: Any, prefix: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                add(item, f"{prefix}{sep}{key}" if prefix else str(key))
        elif isinstance(value, (str, int, float, bool)):
            flat[prefix] = value
        else:
            flat[prefix] = json.dumps(value, default=str)

    add(config, "")
    return flat


# ---- during the run --------------------------------------------------------------------------------

@dataclass
class _Open:
    logger: MetricLogger
    provenance: str
    handle: Any


class Trackers:
    """The started trackers of a run: ``log`` each metrics record, ``finish`` once."""

    def __init__(self, opened: list[_Open] | None = None):
        self._opened = list(opened or [])

    @property
    def names(self) -> list[str]:
        return [item.logger.name for item in self._opened]

    def log(self, record: Mapping[str, Any]) -> None:
        for item in list(self._opened):
            try:
                item.logger.log(item.handle, dict(record))
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                self._drop(item, "log a record", exc)

    def finish(self, summary: Mapping[str, Any] | None, artefacts: Mapping[str, Path]) -> None:
        """Close every tracker (``summary`` None: the run stopped early); later calls do nothing."""
        opened, self._opened = self._opened, []
        for item in opened:
            try:
                item.logger.finish(item.handle, None if summary is None else dict(summary), dict(artefacts))
            except Exception as exc:  # noqa: BLE001 - the run is over; its results are on disk
                _warn(item, "finish", exc, dropped=False)

    def _drop(self, item: _Open, what: str, exc: BaseException) -> None:
        _warn(item, what, exc)
        self._opened.remove(item)
        with contextlib.suppress(Exception):  # close what it holds; its failure was reported already
            item.logger.finish(item.handle, None, {})


def _warn(item: _Open, what: str, exc: BaseException, *, dropped: bool = True) -> None:
    from tqdm import tqdm  # its write clears the progress bar first, so the warning is a line of its own

    then = " and is dropped" if dropped else ""
    tqdm.write(f"posttune: warning: logging: tracker '{item.logger.name}' ({item.provenance}) failed to {what}"
               f"{then}: {_reason(exc)}", file=sys.stderr)


def _reason(exc: BaseException) -> str:
    text = first_line(str(exc))
    return text if isinstance(exc, PosttuneError) else f"{type(exc).__name__}: {text}".rstrip(": ")


def start(loggers: list[Registered], options: Mapping[str, Any], run: TrackerRun) -> Trackers:
    """Start each logger with ``run`` (its own options filled in). One that fails closes those
    already started and stops the run: a one-line PosttuneError naming the tracker."""
    opened: list[_Open] = []
    for item in loggers:
        logger = item.descriptor
        try:
            handle = logger.start(dataclasses.replace(run, options=options.get(logger.name)))
        except Exception as exc:  # noqa: BLE001 - any failure of a tracker becomes one line naming it
            Trackers(opened).finish(None, {})
            raise PosttuneError(f"logging: tracker '{logger.name}' ({item.provenance}) failed to start: "
                                f"{_reason(exc)}") from None
        opened.append(_Open(logger, str(item.provenance), handle))
    return Trackers(opened)


_active: Trackers | None = None


@contextlib.contextmanager
def running(trackers: Trackers) -> Iterator[Trackers]:
    """Make ``trackers`` the ones the metrics log feeds; on leaving, those not finished by then
    (the run was preempted or failed) are finished as stopped early."""
    global _active
    previous, _active = _active, trackers
    try:
        yield trackers
    finally:
        _active = previous
        trackers.finish(None, {})


def active() -> Trackers | None:
    """The trackers of the run in progress in this process (None outside ``running``)."""
    return _active
