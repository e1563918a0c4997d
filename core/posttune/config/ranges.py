"""The allowed range of every numeric field of the run config (docs/config.md, "Ranges").

Types are checked by ``from_dict``; this is the step after it. A value of the right type can
still break a run in ways that show only after the model loaded, or never: a negative
``train.max_grad_norm`` turns clipping into gradient ascent, ``checkpoint.keep_last: 0`` deletes
every checkpoint, a negative ``train.lr`` climbs the loss. ``validate`` refuses them in one line.
Non-finite numbers (``.inf``, ``.nan``) are refused for every float field by ``from_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttune.config.mixture import dataset_sources
from posttune.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """``low <= value`` (``low < value`` when ``low_open``), and ``value < high`` when ``high`` is set.

    ``off``: null is allowed and means this (e.g. "no clipping"); None when null is not allowed.
    """

    low: float
    low_open: bool = False
    high: float | None = None
    off: str | None = None

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value < self.high)

    def describe(self, integer: bool) -> str:
        if integer and self.high is None and not self.low_open and self.low in (0, 1):
            return "a positive integer" if self.low == 1 else "an integer >= 0"
        kind = "an integer" if integer else "a number"
        low = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is None:
            return f"{kind} {low}"
        return f"{kind} {low} and < {_number(self.high)}"


def _number(value: float) -> str:
    if isinstance(value, int) and value > 2**20 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}"


#: dotted field -> its range. Every numeric field of the core schema is here (a test checks it).
RANGES: dict[str, Range] = {
    "data.max_seq_len": Range(1),
    "data.max_prompt_len": Range(1, off="keep the whole prompt"),
    "data.pad_to_multiple_of": Range(1, off="pad to the longest row only"),
    "data.validation_split": Range(0, low_open=True, high=1, off="data.validation, if any, is the validation set"),
    "train.epochs": Range(1),
    "train.max_steps": Range(1, off="train.epochs decides"),
    "train.batch_size": Range(1),
    "train.grad_accum_steps": Range(1),
    "train.lr": Range(0, low_open=True),
    "train.weight_decay": Range(0),
    "train.warmup_steps": Range(0),
    "train.warmup_ratio": Range(0, high=1, off="train.warmup_steps decides"),
    "train.min_lr_ratio": Range(0, high=1),
    "train.decay_ratio": Range(0, low_open=True, high=1, off="0.1"),
    "train.max_grad_norm": Range(0, low_open=True, off="no clipping"),
    "train.skip_nonfinite": Range(0),
    "train.seed": Range(0, high=2**63),
    "train.log_every": Range(1),
    "train.eval_every": Range(1, off="no evaluation during training"),
    "train.early_stopping_patience": Range(1, off="no early stopping"),
    "train.sample_max_new_tokens": Range(1),
    "adapter.rank": Range(1),
    "adapter.alpha": Range(0, low_open=True),
    "adapter.dropout": Range(0, high=1),
    "adapter.loraplus_lr_ratio": Range(0, low_open=True, off="the B matrices learn at train.lr"),
    # `dataset.`: every dataset section (data.train, data.validation, each dataset of a list)
    "dataset.weight": Range(0, low_open=True, off="an equal share"),
    "parallel.timeout_s": Range(0, low_open=True, off="torch's default"),
    "checkpoint.save_every": Range(1, off="no checkpoints, only the final model: not resumable"),
    "checkpoint.keep_last": Range(1, off="keep every checkpoint"),
}


def check_ranges(config: Any) -> None:
    """The first field of ``config`` (a ``RunConfig``) outside its range raises ConfigError."""
    for dotted, allowed in RANGES.items():
        section_name, name = dotted.split(".")
        for where, section in _sections(config, section_name):
            value = getattr(section, name)
            if value is None or isinstance(value, str):
                continue  # the type allows null only where `off` says what it means; a word (epoch) is no number
            if not allowed.contains(value):
                off = f", or null ({allowed.off})" if allowed.off else ""
                raise ConfigError(f"{where}.{name}", f"expected {allowed.describe(isinstance(value, int))}{off}, "
                                                     f"got {value!r}")


def _sections(config: Any, name: str) -> list[tuple[str, Any]]:
    """(field, section) for a RANGES prefix: the config's section of that name unless left out (data in a
    bare config, adapter); ``dataset``: every dataset section, each of a list's as ``data.train[i]``."""
    if name != "dataset":
        section = getattr(config, name)
        return [] if section is None else [(name, section)]
    sections = [(split, getattr(config.data, split) if config.data is not None else None)
                for split in ("train", "validation")]
    return [source for split, dataset in sections if dataset is not None
            for source in dataset_sources(dataset, f"data.{split}")]
