"""posttune-ppo: PPO for RLHF -- a policy and a value model trained on the policy's own samples.

    method:
      name: ppo
      rewards: [{name: reward_model}]   # models.reward: a sequence classifier (posttune-rm); or verifiable rewards
      max_new_tokens: 64
      ppo_epochs: 4                     # optimisation passes over each rollout batch
      num_mini_batches: 1               # optimizer steps per pass (each of grad_accum_steps micro-batches)
      gamma: 1.0                        # GAE discount and lambda
      lam: 0.95
      kl_coef: 0.05                     # per-token KL to the reference, folded into the reward
      cliprange: 0.2                    # policy ratio clip
      cliprange_value: 0.2              # value clip around the rollout's values (null: none)
      vf_coef: 0.1                      # weight of the value loss

Four models: the policy (trained), ``value`` (trained: its own model with a score head, from
``models.value`` or, by default, the policy's checkpoint with a fresh head; or with ``value_model:
head`` a score head on the policy's trunk, one forward for both), ``reward`` (frozen,
for the ``reward_model`` reward) and ``reference`` (frozen; with LoRA the policy with its adapters
off). Generation, the rewards and evaluation are posttune-grpo's (this distribution depends on
it); what PPO adds is in ``experience.py`` (values, KL-shaped token rewards, GAE, whitening) and
``method.py`` (mini-batches per epoch, the clipped losses). docs/ppo.md has every knob.
Written against the public plugin surface only; importing this package imports no torch.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from posttune.plugin import ConfigError, Method, ModelRole, RunConfig, configs_in, hookimpl, resolve_engine
from posttune_grpo import check_no_dropout, check_tis_cap
from posttune_grpo.model_reward import NAME as MODEL_REWARD
from posttune_grpo.model_reward import ROLE as REWARD_ROLE
from posttune_grpo.scoring import RewardSpec

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

CONFIGS = Path(__file__).parent / "configs"
VALUE_ROLE = "value"
REFERENCE_ROLE = "reference"


@dataclass(frozen=True)
class PPOConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {  # TRL's PPOConfig (and GRPO's names) -> here
        "response_length": "method.max_new_tokens", "num_ppo_epochs": "method.ppo_epochs",
        "reward_model_path": "models.reward.path (with method.rewards: [reward_model])",
        "value_model_path": "models.value.path", "sft_model_path": "model.path",
        "stop_token": "the tokenizer's EOS ids (completions end at them)", "beta": "method.kl_coef",
        "epsilon": "method.cliprange", "num_generations": "method.group_size",
        "max_completion_length": "method.max_new_tokens",
    }
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(MODEL_REWARD)])  # summed, weighted
    reward_errors: Literal["raise", "zero"] = "raise"  # a reward returning None or raising: stop, or score 0
    group_size: int = 1  # completions sampled per prompt (PPO's baseline is the value model, not the group)
    max_new_tokens: int = 64  # the longest completion
    temperature: float = 1.0  # sampling temperature (> 0); the loss's log-probs are taken at it too
    top_k: int | None = None  # sample among the k most likely tokens only
    top_p: float | None = None  # nucleus sampling: the most likely tokens reaching probability p, in (0, 1]
    min_p: float | None = None  # drop tokens less likely than min_p times the most likely one, in [0, 1)
    ppo_epochs: int = 4  # optimisation passes over each rollout batch, rows reshuffled each pass
    num_mini_batches: int = 1  # optimizer steps per pass; each is train.grad_accum_steps micro-batches
    gamma: float = 1.0  # discount (1: the episode is one completion)
    lam: float = 0.95  # GAE's lambda
    kl_coef: float = 0.05  # per-token KL penalty to the reference in the reward; 0 builds no reference
    kl_estimator: Literal["k1", "k3"] = "k1"  # log-ratio (k1, the anchors') or k3 (always >= 0)
    cliprange: float = 0.2  # the policy ratio is clipped to [1 - cliprange, 1 + cliprange]
    cliprange_value: float | None = 0.2  # new values are clipped to the rollout's +- this; null: no clipping
    vf_coef: float = 0.1  # weight of the value loss beside the policy loss
    value_model: Literal["model", "head"] = "model"  # its own model (models.value), or a head on the policy's trunk
    whiten_rewards: bool = False  # scale the token rewards to unit variance (mean kept) over the batch
    whiten_advantages: bool = True  # advantages to mean 0, variance 1 over the batch (every rank's)
    missing_eos_penalty: float | None = None  # subtracted from the score of a completion cut at max_new_tokens
    padding_free: bool = True  # the learner's rows end to end as documents, no padding computed (grpo.md)
    share_prompt: bool = True  # with padding_free: each group's prompt computed once in the learner's forward
    engine: str = "builtin"  # the generation engine (`posttune ls engines`)
    engine_options: dict = field(default_factory=dict)  # the engine's settings, checked against its options
    # any engine but builtin samples with another copy of the policy (vllm): each token's policy loss weighted by
    # min(pi_old / pi_behaviour, tis_cap), as GRPO's (docs/grpo.md, "The ratio"); None: no correction
    tis_cap: float | None = 2.0
    # per token or per completion; above tis_cap truncated to it, or masked to 0
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "token_truncate"

    # what posttune-grpo's rollout, engine and evaluation helpers read: PPO's fixed choices for them
    @property
    def scale_rewards(self) -> str:
        return "none"  # PPO's baseline is the value model: the scores stay as they are

    @property
    def baseline(self) -> str:
        return "mean"

    @property
    def filter_equal_rewards(self) -> bool:
        return False

    @property
    def mode(self) -> str:
        return "sync"


def roles(config: PPOConfig) -> tuple[ModelRole, ...]:
    """The value model (trained; by default the policy's checkpoint with a fresh score head, or with
    ``value_model: head`` a score head on the policy's own hidden states), a reference for the KL penalty
    (the policy with adapters off under LoRA), a reward model for ``reward_model``."""
    value = ModelRole(VALUE_ROLE, from_policy=True, trained=True, score=True, on_policy=config.value_model == "head")
    reference = (ModelRole(REFERENCE_ROLE, from_policy=True, adapters_off=True),) if config.kl_coef > 0 else ()
    scored = any(spec.name == MODEL_REWARD for spec in config.rewards)
    return (value, *reference, *((ModelRole(REWARD_ROLE, score=True, own_tokenizer=True),) if scored else ()))


def rows_per_rank(config: RunConfig, method: PPOConfig) -> int:
    return config.train.batch_size * method.group_size


def micro_batch_size(config: RunConfig, method: PPOConfig) -> int:
    """Completions per forward: a mini-batch (``rows / num_mini_batches``) split into ``grad_accum_steps``."""
    return rows_per_rank(config, method) // (method.num_mini_batches * config.train.grad_accum_steps)


def validate(config: RunConfig, method: PPOConfig) -> None:
    from posttune_grpo.scoring import check_rewards

    for name in ("group_size", "max_new_tokens", "ppo_epochs", "num_mini_batches"):
        if getattr(method, name) < 1:
            raise ConfigError(f"method.{name}", f"expected a positive integer, got {getattr(method, name)}")
    for name in ("temperature", "cliprange"):
        value = getattr(method, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"method.{name}", f"expected a positive number, got {value}")
    for name in ("gamma", "lam"):
        value = getattr(method, name)
        if not 0 <= value <= 1:
            raise ConfigError(f"method.{name}", f"expected a value in [0, 1], got {value}")
    for name in ("kl_coef", "vf_coef"):
        value = getattr(method, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"method.{name}", f"expected a number >= 0, got {value}")
    check_tis_cap(method)
    check_no_dropout(config, "ppo")
    if method.cliprange_value is not None and not method.cliprange_value > 0:
        raise ConfigError("method.cliprange_value", f"expected a positive number or null, got {method.cliprange_value}")
    rows, split = rows_per_rank(config, method), method.num_mini_batches * config.train.grad_accum_steps
    if rows % split:
        raise ConfigError("method.num_mini_batches", f"num_mini_batches x train.grad_accum_steps = {split} must divide "
                                                     f"train.batch_size x group_size = {rows} completions per rank")
    for plan in ("tp", "cp", "loss_parallel"):
        if plan in config.parallel.plans:
            raise ConfigError("parallel.plans", f"ppo's value and reward models end in a one-value score head, "
                                                f"which '{plan}' does not split yet; use fsdp2")
    if method.value_model == "head" and "chunked_cross_entropy" in config.memory:
        raise ConfigError("memory", "value_model: head takes the logits and the values from one forward's "
                                    "hidden states, which chunked_cross_entropy would split; drop it or use "
                                    "value_model: model")
    check_rewards(config, method.rewards)
    from posttune.plugin import Sampling  # torch: imported when a run is validated, not at plugin discovery

    from posttune_grpo.rollouts import generation_settings

    resolve_engine(method.engine, method.engine_options, sampling=Sampling(**generation_settings(method)))


def batch_text(config: Any, method: PPOConfig) -> str:
    """The banner's account of a step: prompts, their completions, the mini- and micro-batches trained on."""
    return (f"train.batch_size {config.train.batch_size} prompts x group_size {method.group_size} = "
            f"{rows_per_rank(config, method)} completions per rank a generation, {method.ppo_epochs} epoch(s) of "
            f"{method.num_mini_batches} step(s), in micro-batches of {micro_batch_size(config, method)}")


def micro_batch_tokens(config: Any, method: PPOConfig) -> tuple[int, str]:
    """The tokens of one loss forward (the worst case), for `posttune plan`: each micro-batch runs the policy
    and the value model with gradients on the same rows (the estimate counts both models' activations)."""
    rows = micro_batch_size(config, method)
    prompt = config.data.max_prompt_len or config.data.max_seq_len
    return rows * (prompt + method.max_new_tokens), (
        f"micro-batch {rows} completions x (prompt {prompt} + max_new_tokens {method.max_new_tokens}), every row full")


def _method(name: str, module: str = "method") -> Any:
    """``posttune_ppo.<module>.<name>`` (or a ``package.module``), imported on the first call."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module if "." in module else f"posttune_ppo.{module}"), name)(*args)

    call.__name__ = name
    return call


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="ppo",
        config=PPOConfig,
        dataset_kind="prompt",
        data=_method("data"),
        loss=_method("loss"),
        batches=_method("batches"),
        roles=roles,
        setup=_method("setup"),
        evaluate=_method("evaluate", "posttune_grpo.evaluation"),
        on_step_end=_method("on_step_end", "posttune_grpo.method"),
        state_dict=_method("state_dict"),
        load_state_dict=_method("load_state_dict"),
        validate=validate,
        description="PPO (RLHF): policy and value model, GAE, per-token KL penalty, clipped losses",
        micro_batch_tokens=micro_batch_tokens,
        batch_text=batch_text,
        plot=("reward",),  # the loss plot's second panel: the mean reward, and the validation reward
        close=_method("close", "posttune_grpo.method"),
    ))


@hookimpl
def posttune_register_configs(register):
    for config in configs_in(CONFIGS):
        register(config)
