"""``posttune.train``: a training run from Python, as `posttune train` makes it.

    import posttune

    summary = posttune.train("my.yaml", "train.lr=1e-4")  # as `posttune train my.yaml train.lr=1e-4`

A module of its own: it reaches the command's checks and the training loop, which reach the model API
(`posttune.api`), so nothing in the core imports it back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def train(config: str | Path | Mapping[str, Any], *overrides: str | Sequence[str]) -> dict[str, Any]:
    """Train in this process, as ``posttune train CONFIG OVERRIDES...`` does; returns the run's summary.

    ``config`` is a YAML file, a bundled config's name or a mapping of the same keys (copied, not changed; paths
    may be ``Path``s, numbers numpy's); ``overrides`` are the command's ``key=value`` words (or lists of them).
    The same checks run before anything loads, a mistake raises the command's one-line ``PosttuneError``
    (``ConfigError`` for a config's), and Ctrl-C raises ``KeyboardInterrupt``. The result holds summary.json's
    values (``final_step``, ``train_loss``, ``val_loss``, ...), ``status`` (run.json's: ``finished``, or
    ``preempted`` after a SIGTERM) and ``output_dir``. A second call trains afresh in the same process (a
    notebook's next cell, a sweep's next trial): the run seeds Python's and torch's generators from
    ``train.seed`` and gives the caller's states back after, so a sweep's own random draws are not repeated.
    One process here; several are torchrun's (``posttune train --nproc-per-node N``).
    """
    import json
    import os
    import random

    import torch

    from posttune import training
    from posttune.cli.commands import resolve_run

    words: list[str] = []
    for given in overrides:  # each a 'key=value' string, or a list or tuple of them
        for word in given if isinstance(given, (list, tuple)) else [given]:
            if not isinstance(word, str):
                raise TypeError(f"posttune.train: an override is a 'key=value' string, got {word!r}")
            words.append(word)
    if isinstance(config, Mapping):
        config = _plain(config)
    plan = resolve_run(config, words, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None  # the run would seed it
    generators = random.getstate(), torch.get_rng_state(), cuda
    try:
        with torch.enable_grad(), torch.inference_mode(False):
            training.run(plan)
    finally:
        random.setstate(generators[0])
        torch.set_rng_state(generators[1])
        if generators[2] is not None:
            torch.cuda.set_rng_state_all(generators[2])
    out = Path(plan.config.checkpoint.output_dir)
    found = {}
    for name in ("summary.json", "run.json"):
        try:
            found[name] = json.loads((out / name).read_text())
        except (OSError, ValueError):  # a preempted run writes no summary
            found[name] = {}
    return {**found["summary.json"], "status": found["run.json"].get("status"), "output_dir": str(out)}


def _plain(value: Any) -> Any:
    """A config mapping as YAML would give it: ``os.PathLike`` as text, numpy scalars as Python numbers (a
    sweep's ``np.arange`` grid), recursively; anything else as it is, for the config's checks to judge."""
    import os

    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value
