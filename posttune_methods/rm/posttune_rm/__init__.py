"""posttune-rm: reward models trained on preference pairs (Bradley-Terry), for RLHF.

    method:
      name: reward_model
      margin: 0.0                       # the chosen reward must beat the rejected by this much
      margin_column: null               # or a column giving each pair its own margin (TRL's `margin`)
      center_rewards_coefficient: null  # e.g. 0.01: pulls the rewards' mean towards 0 (Eisenstein et al. 2023)
      padding_free: true                # every response its own document of one row; false: padded rows
      share_prompt: true                # padding-free: each pair's prompt computed once

The policy is the family's decoder with a score head (one value per token) instead of the
vocabulary head; a pair's rewards are the head's values at the last token of the chosen and the
rejected response. The saved model is transformers' ``<Arch>ForSequenceClassification``
(``num_labels`` 1), which GRPO's ``reward_model`` reward and PPO load as a frozen role.

Written against the public plugin surface only (``posttune.plugin``). Importing this package
does not import torch; the loss is in ``losses.py``, the data and loss wiring in ``method.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttune.plugin import ConfigError, DatasetConfig, Method, RunConfig, Session, configs_in, hookimpl

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class RewardModelConfig:
    margin: float = 0.0  # the chosen reward must exceed the rejected by this much before a pair stops teaching
    # a column of the preference rows holding each pair's own margin, a number >= 0 (TRL's `margin` column; Llama 2's
    # margins from how much better the chosen was rated); null: `margin` for every pair
    margin_column: str | None = None
    center_rewards_coefficient: float | None = None  # weight of mean((r_chosen + r_rejected)^2); TRL suggests 0.01
    padding_free: bool = True  # the pairs' responses end to end in one row, each its own document (as DPO)
    share_prompt: bool = True  # padding-free: each pair's prompt computed once (as DPO; the same scores)


def validate(config: RunConfig, method: RewardModelConfig) -> None:
    if not math.isfinite(method.margin) or method.margin < 0:
        raise ConfigError("method.margin", f"expected a number >= 0, got {method.margin}")
    if method.margin_column is not None and not method.margin_column.strip():
        raise ConfigError("method.margin_column", "expected a column name, or null")
    if method.margin_column is not None and method.margin:
        raise ConfigError("method.margin", f"margin_column '{method.margin_column}' gives each pair its own margin; "
                                           "set one of them")
    coefficient = method.center_rewards_coefficient
    if coefficient is not None and not (math.isfinite(coefficient) and coefficient >= 0):
        raise ConfigError("method.center_rewards_coefficient", f"expected a number >= 0 or null, got {coefficient}")
    for plan in ("tp", "cp", "loss_parallel"):  # they split the vocabulary head or the sequence
        if plan in config.parallel.plans:
            raise ConfigError("parallel.plans", f"reward_model does not run under '{plan}' (a one-value head, "
                                                "pooled at each row's last token); shard it with fsdp2")


def micro_batch_tokens(config: Any, method: RewardModelConfig) -> tuple[int, str]:
    """Chosen and rejected in one forward, as DPO: twice SFT's rows (the worst case, every row full)."""
    from posttune.plugin import pair_tokens

    return pair_tokens(config, padding_free=method.padding_free)


def _data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune_rm.method import data

    return data(session, dataset, split)


def _loss(session: Session, batch: Any) -> Any:
    from posttune_rm.method import loss

    return loss(session, batch)


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="reward_model",
        config=RewardModelConfig,
        dataset_kind="preference",
        data=_data,
        loss=_loss,
        validate=validate,
        description="a reward model on preference pairs (Bradley-Terry); saves as a sequence classifier",
        micro_batch_tokens=micro_batch_tokens,
        score_head=True,
    ))


@hookimpl
def posttune_register_configs(register):
    for config in configs_in(CONFIGS):
        register(config)
