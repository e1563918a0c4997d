"""GRPO's evaluation: greedy answers to every validation prompt from the learner's engine, scored.

Logged with a ``val_`` prefix: the mean reward (total and per function) and completion length
over every rank's validation prompts (placeholders excluded), in either mode.
"""

from __future__ import annotations

import torch

from posttune_grpo.in_process import learner_scorer
from posttune_grpo.rollouts import add_in_learner, padded_prompts
from posttune_grpo.scoring import score_batch
from posttune_grpo.state import learner_engine
from posttune.plugin import Session


@torch.no_grad()
def evaluate(session: Session) -> dict[str, float]:
    from posttune.plugin import Sampling, pad_id, sum_over_token_ranks

    config, tokenizer = session.method_config, session.tokenizer
    engine = learner_engine(session)
    greedy = Sampling(config.max_new_tokens, stop_token_ids=tuple(tokenizer.eos_ids), pad_id=pad_id(tokenizer))
    totals: dict[str, list[float]] = {}
    for prompts in session.validation_data:
        prompt_ids, rows = padded_prompts(prompts, session.config.train.batch_size, pad_id(tokenizer))
        completions = engine.generate(prompt_ids, greedy).token_lists()
        real = torch.tensor([float(row >= 0) for row in rows])
        rewards = session.method_state.rewards
        scores = score_batch(tokenizer, rewards, config.reward_errors, prompts, completions, real.tolist(), 1)
        per_reward = {name: torch.tensor(values) for name, values in scores.per_reward.items()}
        total = add_in_learner(tokenizer, rewards, prompts, completions, 1, real, torch.tensor(scores.total),
                               per_reward, learner_scorer(session))
        values = {"reward": total, **{f"reward/{n}": v for n, v in per_reward.items()},
                  "completion_length": [float(len(c)) for c in completions]}
        for name, column in values.items():
            sums = totals.setdefault(name, [0.0, 0.0])
            sums[0] += float((torch.as_tensor(column, dtype=torch.float32) * real).sum())
            sums[1] += float(real.sum())
    keys = sorted(totals)
    if not keys:
        return {}
    flat = torch.tensor([value for key in keys for value in totals[key]], dtype=torch.float64)
    flat = sum_over_token_ranks(flat.to(session.device), session).tolist()
    return {key: flat[2 * i] / max(flat[2 * i + 1], 1.0) for i, key in enumerate(keys)}
