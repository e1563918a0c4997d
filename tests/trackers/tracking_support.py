"""Tiny SFT runs with experiment trackers: configs, and their metrics.jsonl to compare against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from run_support import sft_config

#: three optimizer steps, the validation loss at step 2 (and in the summary, at step 3)
STEPS, EVAL_EVERY = 3, 2


def tracked_config(directory: Path, logging: list[str], options: dict[str, Any] | None = None, *,
                   steps: int = STEPS, **sections: Any) -> Path:
    """A tiny Llama SFT run over 8 rows, validated on them too, logging to ``logging``; its YAML path."""
    train = {"max_steps": steps, "eval_every": EVAL_EVERY, **sections.pop("train", {})}
    config = sft_config(directory, rows=8, train=train, **sections)
    config["data"]["validation"] = dict(config["data"]["train"])
    config["logging"] = logging
    if options:
        config["logging_options"] = options
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the records that hold it."""
    return [(r["step"], r[key]) for r in records if key in r]
