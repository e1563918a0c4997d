"""``posttune.train``: a training run from Python, as `posttune train` makes it.

    import posttune

    summary = posttune.train("my.yaml", "train.lr=1e-4")  # as `posttune train my.yaml train.lr=1e-4`

A module of its own: it reaches the command's checks and the training loop, which reach the model API
(`posttune.api`), so nothing in the core imports it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def train(config: str | Path | Mapping[str, Any], *overrides: str) -> dict[str, Any]:
    """Train in this process, as ``posttune train CONFIG OVERRIDES...`` does; returns the run's summary.

    ``config`` is a YAML file, a bundled config's name or a mapping of the same keys (copied, not changed);
    ``overrides`` are the command's ``key=value`` words. The same checks run before anything loads, a mistake
    raises the command's one-line ``PosttuneError`` (``ConfigError`` for a config's), and Ctrl-C raises
    ``KeyboardInterrupt``. The result holds summary.json's values (``final_step``, ``tokens``, ``val_loss``, ...),
    ``status`` (run.json's: ``finished``, or ``preempted`` after a SIGTERM) and ``output_dir``. A second call
    trains afresh in the same process (a notebook's next cell). One process here; several are torchrun's
    (``posttune train --nproc-per-node N``).
    """
    import json
    import os

    from posttune import training
    from posttune.cli.commands import resolve_run

    plan = resolve_run(config, list(overrides), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    training.run(plan)
    out = Path(plan.config.checkpoint.output_dir)
    found = {}
    for name in ("summary.json", "run.json"):
        try:
            found[name] = json.loads((out / name).read_text())
        except (OSError, ValueError):  # a preempted run writes no summary
            found[name] = {}
    return {**found["summary.json"], "status": found["run.json"].get("status"), "output_dir": str(out)}
