"""GRPO's lifecycle callbacks (plugin API 2): the prompt loader, the epoch's micro-batches, setup,
the step record, checkpoint state and close.

    setup: resolve the rewards; choose the rollout source once, by method.generation
           (local: in_process.py, the learner's engine; ray: ray_actors.py, Ray actors)
    for each epoch (``batches``):
        for each batch of rollouts the source makes (generated, scored, normalised):
            for each of num_iterations passes:
                for each micro-batch: yield it   (the trainer calls ``loss`` (loss.py) and steps)

A checkpoint can fall between two micro-batches of one generation batch: the rollouts not yet
trained on are the method's state (``state_dict``), so a resumed run trains on exactly them
before it draws the next prompts. ``close`` stops what the run started: the source's actors,
the learner's engine and this process's reward workers.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from posttune_grpo.rollouts import Rollouts, micro_batch_size, micro_batches_per_generation
from posttune_grpo.state import GRPOState, count_trained, log_samples
from posttune.plugin import ConfigError, DatasetConfig, Session


class RolloutLoader:
    """The prompt loader, with ``len()`` counting the micro-batches GRPO makes of each prompt batch."""

    def __init__(self, prompts: Any, micro_batches_per_prompt_batch: int):
        self.prompts = prompts
        self.per_batch = micro_batches_per_prompt_batch

    def __iter__(self) -> Any:
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts) * self.per_batch

    def set_epoch(self, epoch: int) -> None:
        self.prompts.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)

    @property
    def epoch(self) -> int:
        return self.prompts.epoch


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import prompt_loader

    prompts = prompt_loader(session, dataset, split)
    if split != "train":
        return prompts
    return RolloutLoader(prompts, micro_batches_per_generation(session))


def setup(session: Session) -> None:
    from posttune.plugin import check_new_tokens
    from posttune_grpo import rollout_source
    from posttune_grpo.python_rewards import file_digests
    from posttune_grpo.scoring import resolve_rewards

    config = session.method_config
    check_new_tokens(session.model, config.max_new_tokens, "method.max_new_tokens", session.config.data.max_prompt_len)
    rewards = resolve_rewards(config.rewards)
    session.method_state = GRPOState(rewards=rewards, completions_to_log=logged_completions(config.log_completions),
                                     reward_files=file_digests(reward.fn for reward in rewards))
    if any(reward.in_learner for reward in session.method_state.rewards):
        from posttune_grpo.model_reward import load_reward_tokenizer

        session.method_state.reward_tokenizer = load_reward_tokenizer(session)
    session.method_state.source = rollout_source(config).start(session)
    if config.sync_reference_every is not None:
        synced_reference(session)  # a reference that does not pair with the policy: refused now


def synced_reference(session: Session) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, reference shard, policy shard) for every weight: what ``sync_reference_every`` mixes."""
    from posttune.plugin import paired_shards

    return paired_shards(session.models["reference"], session.model, "method.sync_reference_every")


def logged_completions(setting: int | bool) -> int:
    """How many of a step's completions ``method.log_completions`` logs: TRL's ``true`` is every one of them."""
    return sys.maxsize if setting is True else int(setting)


def batches(session: Session) -> Any:
    """One epoch of micro-batches: the pending rollouts' rest first (after a resume), then new ones."""
    state: GRPOState = session.method_state
    if state.pending is not None:
        yield from _train_on(session, state)
    for rollouts in state.source.rollouts(session):
        state.pending, state.cursor = rollouts, 0
        yield from _train_on(session, state)


def _train_on(session: Session, state: GRPOState) -> Any:
    pieces = state.pending.micro_batches(micro_batch_size(session))
    total = session.method_config.num_iterations * len(pieces)
    while state.cursor < total:
        piece = pieces[state.cursor % len(pieces)]
        state.cursor += 1  # before yielding: a checkpoint taken now must not train on this one again
        count_trained(state, piece)
        yield piece
    state.pending = None


def on_step_end(session: Session, record: dict[str, Any]) -> None:
    """Reward spread, the longest completion, generation throughput and the split of the step's time."""
    from posttune.plugin import all_reduce_max

    state: GRPOState = session.method_state
    record["completion_length_max"] = int(all_reduce_max(torch.tensor(float(state.longest), device=session.device)))
    mean, mean_sq = record.get("reward"), record.pop("reward_sq", None)
    if mean is not None and mean_sq is not None:  # the sample standard deviation, as TRL's reward_std
        n = trained_completions(session, state.trained)
        record["reward_std"] = math.sqrt(max(mean_sq - mean * mean, 0.0) * n / (n - 1)) if n > 1 else 0.0
    elapsed = time.perf_counter() - state.step_started
    record["generation_s"] = state.generation_seconds
    record["training_s"] = max(elapsed - state.source.waited_s(session), 0.0)
    for name, count in state.reward_failures.items():
        record[f"reward_failures/{name}"] = count
    for name, count in state.reward_timeouts.items():
        record[f"reward_timeouts/{name}"] = count
    # the names stay: a step that trains on an earlier generation batch logs 0 failures, not a gap in the series
    state.reward_failures = dict.fromkeys(state.reward_failures, 0)
    state.reward_timeouts = dict.fromkeys(state.reward_timeouts, 0)
    if state.generation_seconds:
        record["generation_tokens_per_s"] = state.generated_tokens / state.generation_seconds
    state.generation_seconds, state.generated_tokens, state.longest, state.trained = 0.0, 0, 0, 0
    state.step_started = time.perf_counter()
    log_samples(session, state)
    state.source.after_step(session, record)
    every = getattr(session.method_config, "sync_reference_every", None)  # PPO shares this step end
    if every is not None and session.step % every == 0:
        with torch.no_grad():  # TR-DPO's update of the reference, as TRL's GRPO applies it
            for _, reference, policy in synced_reference(session):
                reference.copy_(reference.float().lerp_(policy.float(), session.method_config.sync_reference_alpha))


def trained_completions(session: Session, local: int) -> int:
    """The completions the step trained on, over the ranks that hold different data (each data-parallel rank's
    count summed once, however many ranks of a tensor- or context-parallel group share it)."""
    from posttune.plugin import all_reduce_sum, data_rank

    total = int(all_reduce_sum(torch.tensor(float(local), device=session.device)))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return total * data_rank(session)[1] // world


def state_dict(session: Session) -> dict[str, Any]:
    """The rollouts being trained on and where in them; with Ray actors, the batches handed out and not yet
    trained on too (ray_actors.RaySource.state_dict); the Python reward files' digests, for a resume to compare."""
    state: GRPOState = session.method_state
    saved = {"pending": None if state.pending is None else state.pending.state_dict(), "cursor": state.cursor,
             "reward_files": state.reward_files}
    if hasattr(state.source, "state_dict"):
        saved["handed_out"] = state.source.state_dict()
    every = getattr(session.method_config, "sync_reference_every", None)
    if every is not None and session.step >= every:  # a synced reference: nothing else could rebuild it
        saved["reference"] = {name: weight.detach().cpu().clone() for name, weight, _ in synced_reference(session)}
    return saved


def load_state_dict(session: Session, saved: dict[str, Any]) -> None:
    state: GRPOState = session.method_state
    state.pending = None if saved["pending"] is None else Rollouts.from_state(saved["pending"])
    state.cursor = int(saved["cursor"])
    if saved.get("handed_out") and hasattr(state.source, "load_state_dict"):
        state.source.load_state_dict(saved["handed_out"])
    warn_changed_reward_files(saved, state.reward_files)
    if saved.get("reference") is not None:
        if getattr(session.method_config, "sync_reference_every", None) is None:
            raise ConfigError("method.sync_reference_every", "the checkpoint holds a reference synced with the "
                              "policy; resume with the run's sync_reference_every")
        with torch.no_grad():
            for name, reference, _ in synced_reference(session):
                reference.copy_(saved["reference"][name])


def warn_changed_reward_files(saved: dict[str, Any], now: dict[str, str]) -> None:
    """A reward file edited since the checkpoint (GRPO's and PPO's): one warning per run, from the first rank
    (checkpoints written before the digests were have none: nothing to compare)."""
    from posttune_grpo.python_rewards import warn_changed_files

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warn_changed_files(saved.get("reward_files") or {}, now)


def close(session: Session) -> None:
    """Stop what the run started, each whatever the others do: the source (Ray actors), the learner's
    engine, and this process's reward workers (started by the first isolated reward)."""
    from posttune_grpo.reward_workers import close_shared_pool

    state = session.method_state
    steps = [close_shared_pool]
    if isinstance(state, GRPOState):  # None when setup did not get that far
        steps = [*(part.close for part in (state.source, state.engine) if part is not None), *steps]
        state.source = state.engine = None
    problems = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the next part still has to be closed
            problems.append(exc)
    if problems:
        raise problems[0]
