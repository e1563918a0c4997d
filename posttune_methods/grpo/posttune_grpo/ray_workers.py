"""The Ray actors of ``generation: ray``: engine actors that generate, reward actors that score.

An engine actor holds an engine on its own copy of the policy and turns prompt batches into
completions with their behaviour log-probs; a reward actor scores them and normalises the
rewards into advantages. The learner chains the two per batch (the engine's result goes straight
to a reward actor through Ray's object store), so a slow reward holds up only scoring: the
engine is already on the next batch. Each call carries the weight version it must generate with
and a reference to those weights; an engine behind that version loads them first, so a restarted
actor (Ray reruns ``__init__`` with the spec it was made with) catches up by itself.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from posttune.plugin import PosttuneError


class EngineActor:
    """An engine on its own copy of the policy (version -1 until the first weights arrive)."""

    def __init__(self, spec: dict[str, Any]):
        from posttune.plugin import EnginePolicy, load_tokenizer, start_engine

        from posttune_grpo.rollouts import rollout_sampling

        torch.set_num_threads(spec["threads"])
        self.spec = spec
        self.tokenizer = load_tokenizer(spec["tokenizer"])
        self.engine = start_engine(spec["engine"], spec["engine_options"],
                                   EnginePolicy(spec["family"], spec["build_kwargs"], source=spec["source"],
                                                version=-1,  # Ray shows an actor the GPUs it was given, or none
                                                device="cuda" if torch.cuda.is_available() else None),
                                   sampling=rollout_sampling(spec, self.tokenizer))
        self.idle_since = time.perf_counter()

    def generate(self, prompts: dict[str, Any], epoch: int, version: int, weights: list[Any]) -> dict[str, Any]:
        """``generate_completions`` with the weights of ``version`` (``weights``: [their ObjectRef], nested so
        that Ray fetches them only when this engine is behind)."""
        import ray

        from posttune_grpo.rollouts import generate_completions

        started = time.perf_counter()
        idle = started - self.idle_since
        if self.engine.version != version:
            self.engine.update_weights(ray.get(weights[0]), version)
        generated = generate_completions(self.engine, self.tokenizer, prompts, epoch, self.spec)
        self.idle_since = time.perf_counter()
        return {**generated, "version": version, "engine_idle_s": idle, "seconds": self.idle_since - started}

    def close(self) -> None:
        """Release the engine: the learner kills the actor next."""
        self.engine.close()


class RewardActor:
    """The run's rewards in their own process: completions in, scored and normalised Rollouts out."""

    def __init__(self, spec: dict[str, Any]):
        from posttune.plugin import load_tokenizer

        from posttune_grpo.scoring import RewardSpec, resolve_rewards

        self.spec = spec
        self.tokenizer = load_tokenizer(spec["tokenizer"])
        self.rewards = resolve_rewards([RewardSpec(**r) for r in spec["rewards"]], cwd=spec.get("cwd"))

    def score(self, prompts: dict[str, Any], generated: dict[str, Any]) -> dict[str, Any]:
        from posttune_grpo.rollouts import score_completions

        if generated["version"] < 0:
            raise PosttuneError("generation: ray: an engine actor generated before it received weights")
        rollouts = score_completions(self.tokenizer, self.rewards, prompts, generated, self.spec)
        rollouts.versions = torch.full((len(rollouts),), generated["version"], dtype=torch.long)
        rollouts.seconds = generated["seconds"]
        return {"rollouts": rollouts.state_dict(), "engine_idle_s": generated["engine_idle_s"]}

    def close(self) -> None:
        """Stop this process's isolated reward workers: the learner kills the actor next."""
        from posttune_grpo.reward_workers import close_shared_pool

        close_shared_pool()
