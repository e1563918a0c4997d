"""A toy preference method, written only against the public plugin surface (``posttune.plugin``).

``toy_rank`` is a reference-free ranking loss on preference pairs: the chosen response's mean
token log-probability should beat the rejected one's, ``-log sigmoid(scale * (chosen - rejected))``
per pair, averaged over pairs. It shows every part of the method lifecycle a preference method
needs: its own loader (``PairMaker`` + ``pair_batch``: chosen and rejected in one forward), a
normaliser that counts pairs (not tokens), a metric kept exact across micro-batches and ranks
(``(wins, pairs)``), state that survives a restart (pairs seen so far), and a step-end hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from posttune.plugin import ConfigError, DatasetConfig, LossOutput, RunConfig, Session


@dataclass(frozen=True)
class ToyRankConfig:
    scale: float = 1.0  # how sharply the margin is judged


def validate(config: RunConfig, method: ToyRankConfig) -> None:
    if not method.scale > 0:
        raise ConfigError("method.scale", f"expected a positive number, got {method.scale}")


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import PairMaker, build_loader, dataset_format, pad_id, pair_batch

    config = session.config.data
    make = PairMaker(dataset_format(session, split), session.tokenizer, max_seq_len=config.max_seq_len,
                     max_prompt_len=config.max_prompt_len, column_map=dataset.column_map,
                     skip_bad_rows=config.skip_bad_rows, where=f"data.{split}",
                     system_prompt=dataset.system_prompt)
    collate = partial(pair_batch, pad_id=pad_id(session.tokenizer))
    return build_loader(session, dataset, split, make=make, collate=collate)


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    import torch.nn.functional as F

    from posttune.plugin import sequence_logps, token_logps

    mean_logps = sequence_logps(token_logps(session, batch), batch["labels"], average=True)
    chosen, rejected = mean_logps.chunk(2)
    real = (batch["rows"] >= 0).float()  # a placeholder pair (an empty share of the last batch) counts 0
    margin = chosen - rejected
    losses = -F.logsigmoid(session.method_config.scale * margin) * real
    wins = ((margin > 0).float() * real).sum()
    return LossOutput(losses.sum(), real.sum(), tokens=batch["num_tokens"], unit="pairs",
                      metrics={"accuracy": (wins, real.sum()), "margin": ((margin * real).sum(), real.sum())})


def setup(session: Session) -> None:
    session.method_state = {"pairs_seen": 0}


def on_step_end(session: Session, record: dict[str, Any]) -> None:
    session.method_state["pairs_seen"] += record.get("pairs", 0)  # none in a skipped step's record
    record["pairs_seen"] = session.method_state["pairs_seen"]


def state_dict(session: Session) -> dict[str, int]:
    return dict(session.method_state)


def load_state_dict(session: Session, state: dict[str, int]) -> None:
    session.method_state = {"pairs_seen": int(state["pairs_seen"])}
