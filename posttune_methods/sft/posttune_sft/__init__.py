"""posttune-sft: supervised fine-tuning.

Labels arrive pre-shifted from the data pipeline (``labels[:, t]`` is the target of position
t, -100 where nothing is learned), so the loss is a plain token cross-entropy, and packed
documents never predict across a boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from posttune import hookimpl
from posttune.descriptors import LossOutput, Method

POSTTUNE_PLUGIN_API = 1


@dataclass(frozen=True)
class SFTConfig:
    train_on_input: bool = False  # also learn the prompt (user/system) tokens


def setup(session: Any) -> None:
    """SFT needs no reference model, teacher or generator."""


def batches(session: Any) -> Iterator[dict[str, Any]]:
    yield from session.train_data


def loss(session: Any, batch: dict[str, Any]) -> LossOutput:
    from posttune.losses import token_cross_entropy

    loss_sum, tokens = token_cross_entropy(session, batch)
    return LossOutput(loss_sum, tokens)


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="sft",
        config=SFTConfig,
        dataset_kind="sft",
        setup=setup,
        batches=batches,
        loss=loss,
        description="supervised fine-tuning: cross-entropy on response tokens",
    ))
