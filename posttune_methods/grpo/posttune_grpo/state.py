"""What GRPO keeps between the trainer's calls, in both modes: the rollouts being trained on, where
rollouts come from, the learner's engine, and the figures the next step's record reports.

What one mode alone needs (Ray actors, staleness counts) lives in its rollout source, not here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttune_grpo.rollouts import Rollouts
from posttune.plugin import Session

#: where ``method.log_completions`` writes, in the run's output directory
COMPLETIONS_LOG = "completions.jsonl"


@dataclass
class GRPOState:
    rewards: list[Any] = field(default_factory=list)  # the resolved reward functions
    source: Any = None  # where rollouts come from: in_process.InProcessSource or ray_actors.RaySource
    engine: Any = None  # the generation engine in this process (rollouts in sync mode, evaluation), once started
    pending: Rollouts | None = None  # the generation batch being trained on
    cursor: int = 0  # micro-batches of ``pending`` already handed out (over all iterations)
    generation_seconds: float = 0.0  # since the last optimizer step
    generated_tokens: int = 0
    longest: int = 0  # the longest completion this optimizer step trained on
    trained: int = 0  # the completions this optimizer step trained on (a repeated iteration's too)
    step_started: float = field(default_factory=time.perf_counter)
    reward_failures: dict[str, int] = field(default_factory=dict)  # scored 0 (reward_errors: zero), this step
    reward_timeouts: dict[str, int] = field(default_factory=dict)  # of those, isolated rewards' timeouts
    reward_tokenizer: Any = None  # the reward model's tokenizer, when a reward model scores (model_reward.py)
    completions_to_log: int = 0  # method.log_completions
    reward_files: dict[str, str] = field(default_factory=dict)  # each Python reward file's sha256, at setup
    # the step's first completions (prompt ids, completion ids, reward, per reward, advantage), for the log
    samples: list[tuple[Any, ...]] = field(default_factory=list)


def learner_engine(session: Session) -> Any:
    """The engine that generates in this process (``method.engine``), started on the policy the first
    time it is needed and brought to the current weights (version: the optimizer step) before each use."""
    state: GRPOState = session.method_state
    if state.engine is None:
        from posttune.plugin import start_engine

        from posttune_grpo.rollouts import rollout_sampling, rollout_spec

        config = session.method_config
        state.engine = start_engine(config.engine, config.engine_options, session,
                                    sampling=rollout_sampling(rollout_spec(session), session.tokenizer))
    if state.engine.version != session.step:
        state.engine.update_weights(None, session.step)
    return state.engine


def count_rollouts(state: GRPOState, rollouts: Rollouts) -> None:
    """Add a batch of rollouts to the generation figures the next step record reports (both modes)."""
    real = (rollouts.rows >= 0).long()
    state.generation_seconds += rollouts.seconds
    state.generated_tokens += int((rollouts.lengths * real).sum())
    for name, count in rollouts.reward_failures.items():
        state.reward_failures[name] = state.reward_failures.get(name, 0) + count
    for name, count in rollouts.reward_timeouts.items():
        state.reward_timeouts[name] = state.reward_timeouts.get(name, 0) + count
    keep_samples(state, rollouts)


def count_trained(state: GRPOState, batch: dict[str, Any]) -> None:
    """Add a micro-batch about to be trained on to the step's figures (``trained``, ``longest``): the step
    record describes what it trained on, an earlier generation batch's repeated iteration too."""
    real = batch["rows"] >= 0
    state.trained += int(real.sum())
    state.longest = max(state.longest, int((batch["lengths"] * real).max()))


def keep_samples(state: GRPOState, rollouts: Rollouts) -> None:
    """The first real completions of the step, up to ``completions_to_log``, for ``log_samples``."""
    for row in range(len(rollouts)):
        if len(state.samples) >= state.completions_to_log:
            return
        if rollouts.rows[row] < 0:
            continue
        start, length = int(rollouts.prompt_lengths[row]), int(rollouts.lengths[row])
        ids = rollouts.input_ids[row]
        state.samples.append((ids[:start].tolist(), ids[start:start + length].tolist(), float(rollouts.rewards[row]),
                              {name: float(values[row]) for name, values in rollouts.per_reward.items()},
                              float(rollouts.advantages[row])))


def log_samples(session: Session, state: GRPOState) -> None:
    """Append the step's kept completions to ``<output_dir>/completions.jsonl`` (the first process's rows),
    one JSON line each: the step, the prompt as rendered, the completion as the rewards read it, the reward
    and each reward function's value, and the advantage (TRL's ``log_completions``)."""
    samples, state.samples = state.samples, []
    if not samples or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    tokenizer = session.tokenizer
    path = Path(session.config.checkpoint.output_dir) / COMPLETIONS_LOG
    with path.open("a", encoding="utf-8") as out:
        for prompt, completion, reward, per_reward, advantage in samples:
            line = {"step": session.step, "prompt": tokenizer.decode(prompt),
                    "completion": tokenizer.decode(completion, skip_special_tokens=True), "reward": reward,
                    **{f"reward/{name}": value for name, value in per_reward.items()}, "advantage": advantage}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
