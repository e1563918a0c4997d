"""Rollouts: one rank's prompts, each completed ``group_size`` times, scored, and cut into micro-batches.

The tensors are laid out for the loss as every posttune method sees its data: each completion
is a row ``prompt + completion`` (right-padded), ``labels`` hold the completion tokens
pre-shifted (``labels[:, t]`` is the target of position t, -100 elsewhere), and every per-token
tensor (behaviour and reference log-probs) is aligned with ``labels``. A rank always holds
``batch_size * group_size`` rows: a missing prompt (the last, short share of an epoch) is a
placeholder row of weight 0, so every rank runs the same number of forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

IGNORE_INDEX = -100
#: the per-row tensors a Rollouts keeps (and a checkpoint saves); the rest is bookkeeping
ROW_TENSORS = ("input_ids", "labels", "behaviour_logps", "old_logps", "ref_logps", "advantages", "weights",
               "rewards", "lengths", "truncated", "rows", "versions", "equal")


@dataclass
class Rollouts:
    input_ids: torch.Tensor  # [N, S]
    labels: torch.Tensor  # [N, S], the completion tokens pre-shifted
    behaviour_logps: torch.Tensor  # [N, S], the sampler's log-probs of the completion tokens
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N]: 1 trains, 0 left out (placeholder, or a filtered group)
    rewards: torch.Tensor  # [N], the weighted total
    lengths: torch.Tensor  # [N] completion tokens
    prompt_lengths: torch.Tensor  # [N] prompt tokens
    truncated: torch.Tensor  # [N] 1.0 where the completion hit max_new_tokens without stopping
    rows: torch.Tensor  # [N] the dataset row of each completion's prompt, -1 for a placeholder
    per_reward: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N] unweighted values
    old_logps: torch.Tensor | None = None  # [N, S] recomputed before the first update (num_iterations > 1)
    ref_logps: torch.Tensor | None = None  # [N, S] the reference's (beta > 0)
    versions: torch.Tensor | None = None  # [N] the policy version that generated each row (async mode)
    equal: torch.Tensor | None = None  # [N] 1.0 where the row's group scored all alike (zero advantage)
    seconds: float = 0.0  # generation time
    reward_failures: dict[str, int] = field(default_factory=dict)
    reward_timeouts: dict[str, int] = field(default_factory=dict)  # of the failures, isolated rewards' timeouts

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, size: int) -> list[dict[str, Any]]:
        """The rows in order, ``size`` at a time, as loss inputs (tensors only, plus metric sums)."""
        out = []
        for start in range(0, len(self), size):
            part = slice(start, start + size)
            batch: dict[str, Any] = {name: getattr(self, name)[part] for name in ROW_TENSORS
                                     if getattr(self, name) is not None}
            batch["per_reward"] = {name: values[part] for name, values in self.per_reward.items()}
            # what the forward processes: prompt and completion tokens of the rows that are real
            real = (self.weights[part] > 0).long()
            batch["num_tokens"] = ((self.prompt_lengths[part] + self.lengths[part]) * real).sum()
            out.append(batch)
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["per_reward"] = dict(self.per_reward)
        state["reward_failures"] = dict(self.reward_failures)
        state["reward_timeouts"] = dict(self.reward_timeouts)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollouts:
        return cls(**state)


def build_rows(prompts: list[torch.Tensor], completions: list[list[int]], behaviour: list[torch.Tensor],
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, behaviour log-probs aligned with labels), each ``[N, S]``, right-padded."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    count = len(prompts)
    input_ids = torch.full((count, length), pad_id, dtype=torch.long)
    labels = torch.full((count, length), IGNORE_INDEX, dtype=torch.long)
    logps = torch.zeros((count, length), dtype=torch.float32)
    for row, (prompt, completion, logp) in enumerate(zip(prompts, completions, behaviour, strict=True)):
        start, end = len(prompt), len(prompt) + len(completion)
        input_ids[row, :start] = prompt.cpu()
        input_ids[row, start:end] = torch.tensor(completion, dtype=torch.long)
        # completion token j sits at position start + j and is the target of position start + j - 1
        labels[row, start - 1:end - 1] = torch.tensor(completion, dtype=torch.long)
        logps[row, start - 1:end - 1] = logp[: len(completion)].cpu()
    return input_ids, labels, logps
