"""posttune-loss-parallel: vocabulary-parallel cross-entropy on top of ``tp``.

The head (``output``) is split over the vocabulary with its logits left as a ``Shard(-1)``
DTensor, and each micro-batch's forward, loss and backward run inside
``torch.distributed.tensor.parallel.loss_parallel()`` (torch requires the context around both
the loss and its backward): softmax statistics are reduced across ranks instead of gathering
``[batch, seq, vocab]`` logits on every rank. Methods need no change: ``F.cross_entropy`` on
the DTensor logits is what the context parallelises. Importing this package does not import torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from posttune import hookimpl
from posttune.plugin import ModelTarget, ParallelPlan, Session

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

ORDER = 5  # before tp (10)
HEAD = "output"  # the native model contract: ``model.output`` is the head
#: set on tp before launch: every model tp splits (frozen roles too) keeps its head's logits vocabulary-sharded
TP_OPTIONS = {"styles": {HEAD: "colwise_vocab_sharded"}}


def apply(session: Session, target: ModelTarget) -> None:
    """Once, for the policy: ``token_logps``/``token_cross_entropy`` run inside the context."""
    session.step_contexts.append(vocab_parallel_loss)


@contextlib.contextmanager
def vocab_parallel_loss(session: Session, batch: Any) -> Iterator[None]:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def validate(config: Any) -> None:
    """Generation needs whole logits: the core's greedy samples (as GRPO's rollouts) cannot run here yet."""
    if config.train.sample_prompts:
        from posttune.plugin import ConfigError

        raise ConfigError("train.sample_prompts", "generating them needs whole logits, which loss_parallel keeps "
                                                  "vocabulary-sharded; drop the sample prompts (or loss_parallel)")


PLAN = ParallelPlan(
    name="loss_parallel",
    apply=apply,
    validate=validate,
    order=ORDER,
    requires=("tp",),
    conflicts=("chunked_cross_entropy",),  # posttune-memory's technique wants the head whole; this keeps it sharded
    adjusts={"tp": TP_OPTIONS},
    frozen="skip",  # session-wide: applied once with the policy
    description="cross-entropy over vocabulary-sharded logits (no rank holds full logits); needs tp",
)


@hookimpl
def posttune_register_parallel_plans(register):
    register(PLAN)
