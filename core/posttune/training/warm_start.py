"""`train_briefly`: a few hundred supervised steps on a chat dataset, for examples that need a model to start from.

An RL example needs a policy that is right some of the time, a distillation example a frozen
model that knows the task; neither should need another method plugin installed. This is the
plainest supervised loop over the core's data toolkit -- AdamW, linear warm-up, clipping, the
summed token cross-entropy divided by the labelled tokens -- not a substitute for posttune-sft
(no resume, no validation, no parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def train_briefly(model: torch.nn.Module, tokenizer: Any, data: str | Path, *, steps: int, lr: float = 2e-3,
                  batch_size: int = 32, max_seq_len: int = 64, warmup_steps: int = 100, seed: int = 0,
                  log: Callable[[str], None] | None = print) -> torch.nn.Module:
    """Train ``model`` for ``steps`` optimizer steps on the chat rows of ``data`` (a .jsonl file); in place."""
    from posttune.config.schema import DatasetConfig
    from posttune.data import SampleMaker, make_loader, pad_id, padded_batch
    from posttune.losses import token_cross_entropy
    from posttune.plugins import get_registry

    torch.manual_seed(seed)
    make = SampleMaker(get_registry().get("dataset_format", "chat"), tokenizer, max_seq_len=max_seq_len,
                       where="warm start")
    loader = make_loader(DatasetConfig(str(data)), make=make, max_seq_len=max_seq_len, batch_size=batch_size,
                         seed=seed, collate=partial(padded_batch, pad_id=pad_id(tokenizer)), where="warm start")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
    session, done = SimpleNamespace(model=model.train(), loss_kernel=None), 0
    while done < steps:
        for batch in loader:
            loss, tokens = token_cross_entropy(session, batch)
            (loss / tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if log is not None and (done % 50 == 0 or done == steps):
                log(f"warm start: step {done}/{steps}, loss {float(loss.detach() / tokens):.3f}")
            if done == steps:
                break
    return model.eval()
