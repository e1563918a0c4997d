"""posttune-grpo: GRPO -- online RL with verifiable rewards, in sync mode or async on Ray.

    method:
      name: grpo
      group_size: 8                  # completions per prompt
      max_new_tokens: 256
      temperature: 1.0
      rewards: [{name: math_answer}, {name: format, weight: 0.5}]
      scale_rewards: group           # group | batch | none (Dr. GRPO)
      baseline: mean                 # mean | leave_one_out (RLOO: the mean of the other completions)
      loss_aggregation: token        # token (DAPO) | sequence (GRPO) | constant (Dr. GRPO)
      num_iterations: 1              # optimisation passes per generation batch
      epsilon: 0.2                   # clip range; epsilon_high > epsilon is DAPO's clip-higher
      importance_sampling_level: token  # token | sequence (GSPO) | sequence_sum (RLOO): one ratio per completion
      mask_truncated_completions: false # DAPO's overlong filtering: no loss from completions cut off
      beta: 0.0                      # KL to the reference (k3); 0 builds no reference model
      kl_in_reward: false            # true: beta x the summed log-ratio off the reward instead (RLOO)
      sync_reference_every: null     # TR-DPO's update of the reference every this many steps
      engine: builtin                # the generation engine (`posttune ls engines`)
      padding_free: true             # the learner's rows end to end, each group's prompt once

Every knob, with the paper it comes from, is in docs/grpo.md. Written against the public
plugin surface only (``posttune.plugin``); importing this package imports neither torch nor the
reward libraries.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from posttune.plugin import ConfigError, Method, ModelRole, RunConfig, configs_in, hookimpl, resolve_engine
from posttune_grpo.model_reward import NAME as MODEL_REWARD
from posttune_grpo.model_reward import REWARD as MODEL_REWARD_FUNCTION
from posttune_grpo.model_reward import ROLE as REWARD_ROLE
from posttune_grpo.rewards import REWARDS
from posttune_grpo.scoring import RewardSpec

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

CONFIGS = Path(__file__).parent / "configs"


#: the staleness bound each mode uses when ``ray_options.max_staleness`` is not set
DEFAULT_STALENESS = {"sync": 0, "async": 1, "off_policy": 2}


@dataclass(frozen=True)
class RayOptions:
    """`method.ray_options`: rollouts made by Ray actors (``generation: ray``; pip install 'posttune-grpo[ray]')."""

    MOVED: ClassVar[dict[str, str]] = {"tis_cap": "method.tis_cap", "tis_mode": "method.tis_mode"}

    actors: int = 1  # engine actors in all, split evenly over the learner ranks
    scorers: int = 1  # reward actors per learner rank (scoring runs beside generation, not in it)
    sync_every: int = 1  # optimizer steps between weight pushes to the actors
    max_staleness: int | None = None  # versions a rollout may lag the weights it trains; default by mode
    queue_size: int = 4  # generation batches handed out and not yet trained on, per learner rank
    ray_address: str | None = None  # an existing Ray cluster; default: a local one (ray.init())
    threads_per_actor: int = 1  # torch threads in each actor
    gpus_per_actor: float = 0.0  # Ray GPUs each engine actor holds (vllm on GPU nodes)


@dataclass(frozen=True)
class GRPOConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {  # TRL's GRPOConfig -> here
        "num_generations": "method.group_size", "max_completion_length": "method.max_new_tokens",
        "loss_type": "method.loss_aggregation (dapo: token, grpo: sequence, dr_grpo: constant) and method.objective "
                     "(cispo, sapo)",
        "reward_weights": "the weight of each method.rewards entry", "use_vllm": "method.engine: vllm (posttune-vllm)",
        "max_prompt_length": "data.max_prompt_len", "rloo_k": "method.group_size",
        "num_completions_to_print": "method.log_completions (written to completions.jsonl in the output "
                                    "directory)",
        "use_bias_correction_kl": "method.bias_correction_kl",
        "vllm_importance_sampling_mode": "method.tis_mode", "vllm_importance_sampling_clip_max": "method.tis_cap",
        "vllm_importance_sampling_cap": "method.tis_cap",
        "sync_ref_model": "method.sync_reference_every (the steps between syncs; null: a fixed reference)",
        "ref_model_sync_steps": "method.sync_reference_every", "ref_model_mixup_alpha": "method.sync_reference_alpha",
        "vllm_mode": "method.engine: vllm (colocate: in the training process, method.generation: local; "
                     "in Ray engine actors: method.generation: ray)",
        "vllm_gpu_memory_utilization": "method.engine_options.memory_fraction (docs/vllm.md)",
        "vllm_importance_sampling_correction": "method.tis_cap (null: no correction)",
        "generation_batch_size": "train.batch_size prompts x method.group_size completions per generation batch",
        "steps_per_generation": "method.micro_batch_size and train.grad_accum_steps (a generation batch is "
                                "trained in micro-batches of micro_batch_size completions, grad_accum_steps a step)",
        "chat_template_kwargs": "tokenizer.chat_template_kwargs",
        "kl_coef": "method.beta", "cliprange": "method.epsilon", "num_ppo_epochs": "method.num_iterations",
    }
    KNOWN_VALUES: ClassVar[dict[str, dict[str, str]]] = {  # TRL's loss_type values, and RLOO's and TRL's names
        "loss_aggregation": {"dapo": "token", "bnpo": "token (over the whole step; TRL's bnpo: per micro-batch)",
                             "grpo": "sequence", "dr_grpo": "constant",
                             "cispo": "method.objective: cispo", "sapo": "method.objective: sapo"},
        "objective": {"grpo": "clip", "dapo": "clip", "dr_grpo": "clip with loss_aggregation: constant"},
        "baseline": {"rloo": "leave_one_out", "grpo": "mean"},
    }
    group_size: int = 8  # completions sampled per prompt, compared within their group (at least 2)
    max_new_tokens: int = 256  # the longest completion
    temperature: float = 1.0  # sampling temperature (> 0); the loss's log-probs are taken at it too
    top_k: int | None = None  # sample among the k most likely tokens only
    top_p: float | None = None  # nucleus sampling: the most likely tokens reaching probability p, in (0, 1]
    min_p: float | None = None  # drop tokens less likely than min_p times the most likely one, in [0, 1)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("math_answer")])  # summed, weighted
    reward_errors: Literal["raise", "zero"] = "raise"  # a reward returning None or raising: stop, or score 0
    # advantage / the group's or batch's std, or not (TRL's true and false are group and none)
    scale_rewards: Literal["group", "batch", "none"] | bool = "group"
    # what a reward is compared with: its group's mean, or (RLOO) the mean of the group's other rewards
    baseline: Literal["mean", "leave_one_out"] = "mean"
    loss_aggregation: Literal["token", "sequence", "constant"] = "token"  # mean per token, per completion, or constant
    num_iterations: int = 1  # optimisation passes over each generation batch
    epsilon: float = 0.2  # clip range: a token's ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # default: epsilon (symmetric clipping); cispo: 4.0 (weights capped at 5)
    # clip: PPO's clipped surrogate; cispo: the importance weight clipped (at 1 + epsilon_high) and detached,
    # every token keeps its gradient (MiniMax-M1); sapo: a smooth gate in place of the clip (Qwen's SAPO)
    objective: Literal["clip", "cispo", "sapo"] = "clip"
    sapo_temperature_pos: float = 1.0  # sapo: the gate's temperature for positive advantages
    sapo_temperature_neg: float = 1.05  # sapo: and for the others (a steeper gate: negative updates fade sooner)
    # clip: INTELLECT-2's two-sided clipping, the unclipped ratio capped at delta too (above 1 + epsilon_high)
    delta: float | None = None
    # DeepSeek-V3.2: leave out a completion with a negative advantage whose mean log-ratio of the sampler's
    # policy to the learner's, over its tokens, is above this
    off_policy_mask_threshold: float | None = None
    # token: one ratio per token; sequence: GSPO's one ratio per completion, exp(mean over its tokens of
    # logp - logp_old), clipped as a whole (GSPO's clip ranges are tiny: epsilon 3e-4, epsilon_high 4e-4);
    # sequence_sum: RLOO's, the completion's likelihood ratio exp(sum over its tokens of logp - logp_old)
    importance_sampling_level: Literal["token", "sequence", "sequence_sum"] = "token"
    mask_truncated_completions: bool = False  # completions cut off at max_new_tokens left out of the loss (DAPO)
    # "Beyond the 80/20 Rule": only this share of the trained completion tokens, those where the policy's
    # distribution (at the sampling temperature) has the highest entropy, take the policy term; 1: every token
    top_entropy_quantile: float = 1.0
    beta: float = 0.0  # weight of the per-token KL to the reference model; 0 builds no reference
    # where the KL to the reference acts: false, beta times its k3 estimate in each token's loss (GRPO); true,
    # beta times the completion's summed log-ratio taken from its reward before the baseline (RLOO, TRL's RLOO)
    kl_in_reward: bool = False
    bias_correction_kl: bool = False  # the KL term times the importance ratio (DeepSeek-V3.2; TRL's default)
    # TR-DPO's reference for the KL term: every this many optimizer steps, ref <- alpha x policy + (1 - alpha) x
    # ref (TRL's sync_ref_model, ref_model_sync_steps); null: a fixed reference
    sync_reference_every: int | None = None
    sync_reference_alpha: float = 0.6  # the mix (TRL's ref_model_mixup_alpha); 1: the policy replaces it
    # the correction for rollouts sampled by another copy of the policy (the Ray modes' actors; in sync mode
    # any engine but builtin, e.g. vllm): each token's loss weighted by min(pi_old / pi_behaviour, tis_cap);
    # None: no correction
    tis_cap: float | None = 2.0
    # per token or per completion; above tis_cap truncated to it, or masked to 0 (TRL's
    # vllm_importance_sampling_mode)
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "token_truncate"
    filter_equal_rewards: bool = False  # leave out groups whose rewards are all equal (they teach nothing)
    # completions per optimizer step written to <output_dir>/completions.jsonl with their prompt, rewards and
    # advantage (the first process's first ones; TRL's log_completions); 0 or false: none; true: all of them
    log_completions: int | bool = 0
    micro_batch_size: int | None = None  # completions per forward/backward; default: the rank's whole batch
    mode: Literal["sync", "async", "off_policy"] = "sync"  # alternate, overlap (staleness <= 1), or bounded lag
    generation: Literal["local", "ray"] | None = None  # where rollouts are made; default local for sync, else ray
    ray_options: RayOptions = field(default_factory=RayOptions)  # generation ray: the actors (docs/grpo.md)
    engine: str = "builtin"  # the generation engine, in the learner and in each actor (`posttune ls engines`)
    engine_options: dict = field(default_factory=dict)  # the engine's settings, checked against its options
    # the learner's forwards take a micro-batch's completions end to end in one row, each its own document:
    # no padding computed (the padded rows' losses); false: padded rows (also kept under a plan whose step
    # context reshapes the padded batch)
    padding_free: bool = True
    share_prompt: bool = True  # padding-free: a group's prompt computed once for all its completions

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):  # TRL's older spelling: true scales by the group's std
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")


#: where rollouts come from, by ``method.generation``: the module whose ``validate(config, method)`` checks
#: its settings and whose ``start(session)`` makes the source (the one place ``generation`` is read)
ROLLOUT_SOURCES = {"local": "posttune_grpo.in_process", "ray": "posttune_grpo.ray_actors"}


def generation_of(method: GRPOConfig) -> str:
    """Where rollouts are made: as set, else in the learner for ``mode: sync`` and in Ray actors otherwise."""
    return method.generation or ("local" if method.mode == "sync" else "ray")


def rollout_source(method: GRPOConfig) -> Any:
    return importlib.import_module(ROLLOUT_SOURCES[generation_of(method)])


def roles(config: GRPOConfig) -> tuple[ModelRole, ...]:
    """A reference only for the KL term: by default from the policy's source, and with LoRA the policy
    with its adapters disabled; a reward model (``models.reward``) for the ``reward_model`` reward."""
    reference = (ModelRole("reference", from_policy=True, adapters_off=True),) if config.beta > 0 else ()
    scored = any(spec.name == MODEL_REWARD for spec in config.rewards)
    return reference + ((ModelRole(REWARD_ROLE, score=True, own_tokenizer=True),) if scored else ())


def check_tis_cap(method: Any) -> None:
    """``tis_cap`` (GRPO's and PPO's): a weight capped below 1 would shrink every sample's term."""
    if method.tis_cap is not None and not method.tis_cap >= 1:
        raise ConfigError("method.tis_cap", f"expected a number >= 1 (or null), got {method.tis_cap}")


def check_no_dropout(config: RunConfig, method: str) -> None:
    """GRPO's and PPO's ratios compare the policy with the log-probs it gave without dropout (generation, pi_old):
    adapter dropout in the training forward made them differ before any update (first-pass ratios 0.7 to 1.2, a
    quarter of the tokens clipped), so it is refused, as TRL turns dropout off for these methods."""
    if config.adapter is not None and config.adapter.dropout:
        raise ConfigError("adapter.dropout", f"{method} compares the policy's log-probs with those it gave without "
                                             "dropout, which dropout would set apart before any update; set "
                                             "adapter.dropout: 0 (TRL disables dropout for it too)")


def check_sync(config: RunConfig, method: GRPOConfig) -> None:
    """A synced reference (TR-DPO's update, as TRL's GRPO offers it): a reference of its own, in the learner."""
    every, alpha = method.sync_reference_every, method.sync_reference_alpha
    if not (math.isfinite(alpha) and 0 < alpha <= 1):
        raise ConfigError("method.sync_reference_alpha", f"expected a weight in (0, 1], got {alpha}")
    if every is None and alpha != GRPOConfig.sync_reference_alpha:
        raise ConfigError("method.sync_reference_alpha", "only sync_reference_every uses it")
    if every is not None and every < 1:
        raise ConfigError("method.sync_reference_every", f"expected a number of steps >= 1 (null: a fixed "
                                                         f"reference), got {every}")
    if every is not None and method.beta == 0:
        raise ConfigError("method.sync_reference_every", "beta is 0: the run has no reference model to sync")
    if every is not None and config.adapter is not None:
        raise ConfigError("method.sync_reference_every", "with an adapter the reference shares the policy's base "
                                                         "weights; a synced reference needs one of its own (full "
                                                         "fine-tuning, as TRL)")


def validate(config: RunConfig, method: GRPOConfig) -> None:
    from posttune_grpo.scoring import check_rewards

    positive = {"group_size": method.group_size, "max_new_tokens": method.max_new_tokens,
                "num_iterations": method.num_iterations}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"method.{name}", f"expected a positive integer, got {value}")
    if method.group_size < 2:
        raise ConfigError("method.group_size", "GRPO compares completions within a group: at least 2")
    for name in ("temperature", "epsilon", "sapo_temperature_pos", "sapo_temperature_neg"):
        value = getattr(method, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"method.{name}", f"expected a positive number, got {value}")
    high = method.epsilon_high
    if high is not None and method.objective == "clip" and not high >= method.epsilon:
        raise ConfigError("method.epsilon_high", f"must be at least epsilon ({method.epsilon}), got {high}")
    if high is not None and not (math.isfinite(high) and high >= 0):
        raise ConfigError("method.epsilon_high", f"expected a number >= 0, got {high}")
    if not (math.isfinite(method.beta) and method.beta >= 0):
        raise ConfigError("method.beta", f"expected a number >= 0, got {method.beta}")
    if method.delta is not None:
        if method.objective != "clip":
            raise ConfigError("method.delta", f"caps the clip objective's ratio; objective {method.objective} has "
                                              "no such term: remove it")
        upper = 1 + (method.epsilon if method.epsilon_high is None else method.epsilon_high)
        if not (math.isfinite(method.delta) and method.delta > upper):
            raise ConfigError("method.delta", f"must be above 1 + epsilon_high (the clip's upper bound, {upper}), "
                                              f"got {method.delta}")
    threshold = method.off_policy_mask_threshold
    if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
        raise ConfigError("method.off_policy_mask_threshold", f"expected a number >= 0, got {threshold}")
    if method.bias_correction_kl and (method.beta == 0 or method.kl_in_reward):
        raise ConfigError("method.bias_correction_kl", "weights the loss's KL term, and this run has none "
                                                       "(beta 0, or kl_in_reward): remove it")
    check_sync(config, method)
    check_no_dropout(config, "grpo")
    if method.kl_in_reward and method.beta == 0:
        raise ConfigError("method.kl_in_reward", "puts beta times the KL in the reward, and beta is 0: set "
                                                 "method.beta (TRL's RLOO uses 0.05)")
    check_tis_cap(method)
    if not 0 <= method.top_entropy_quantile <= 1:
        raise ConfigError("method.top_entropy_quantile", f"expected a share in [0, 1], got "
                                                         f"{method.top_entropy_quantile}")
    if method.log_completions < 0:
        raise ConfigError("method.log_completions", f"expected an integer >= 0, got {method.log_completions}")
    if method.top_k is not None and method.top_k < 1:
        raise ConfigError("method.top_k", f"expected a positive integer, got {method.top_k}")
    if method.top_p is not None and not 0 < method.top_p <= 1:
        raise ConfigError("method.top_p", f"expected a value in (0, 1], got {method.top_p}")
    if method.min_p is not None and not 0 <= method.min_p < 1:
        raise ConfigError("method.min_p", f"expected a value in [0, 1), got {method.min_p}")
    rows = config.train.batch_size * method.group_size
    micro = method.micro_batch_size or rows
    if micro < 1 or rows % micro:
        raise ConfigError("method.micro_batch_size", f"must divide train.batch_size x group_size = {rows} "
                                                     f"completions per rank, got {micro}")
    passes, accum = method.num_iterations * (rows // micro), config.train.grad_accum_steps
    if method.num_iterations > 1 and accum > rows // micro:  # a pass again inside a step: the policy unchanged
        raise ConfigError("method.num_iterations", f"its {method.num_iterations} passes over a generation batch of "
                                                   f"{rows // micro} micro-batches must fall in different optimizer "
                                                   f"steps, but train.grad_accum_steps {accum} puts a micro-batch "
                                                   "twice in one step (the same gradient again); set "
                                                   f"train.grad_accum_steps to at most {rows // micro}")
    if passes % config.train.grad_accum_steps:
        raise ConfigError("train.grad_accum_steps", f"must divide the {passes} micro-batches of each generation "
                                                    f"batch (num_iterations x completions / micro_batch_size), got "
                                                    f"{config.train.grad_accum_steps}")
    for plan in ("loss_parallel", "cp"):
        if plan in config.parallel.plans:
            raise ConfigError("parallel.plans", f"grpo generates completions, which '{plan}' cannot run yet; "
                                                "drop it (tp alone works, with sequence_parallel: false)")
    if "tp" in config.parallel.plans and config.parallel.options.get("tp", {}).get("sequence_parallel", True):
        raise ConfigError("parallel.options.tp.sequence_parallel", "grpo generates one token at a time, which "
                                                                   "sequence parallelism cannot split over the TP "
                                                                   "ranks; set it to false")
    check_rewards(config, method.rewards)
    script = [i for i, spec in enumerate(method.rewards) if spec.name.startswith("__main__:")]
    if script and generation_of(method) != "local":
        raise ConfigError(f"method.rewards[{script[0]}].name", f"'{method.rewards[script[0]].name}' is a function of "
                                                               "this script, which Ray's reward actors cannot import; "
                                                               "put it in a file (file.py:function) or a module")
    scored = [i for i, spec in enumerate(method.rewards) if spec.name == MODEL_REWARD]
    if scored and generation_of(method) != "local":
        raise ConfigError(f"method.rewards[{scored[0]}].name", f"'{MODEL_REWARD}' scores in the learner process; "
                                                               "it runs with generation: local (mode: sync) for now")
    from posttune.plugin import Sampling  # torch: imported when a run is validated, not at plugin discovery

    from posttune_grpo.rollouts import generation_settings

    resolve_engine(method.engine, method.engine_options, sampling=Sampling(**generation_settings(method)))
    rollout_source(method).validate(config, method)


def batch_text(config: Any, method: GRPOConfig) -> str:
    """The banner's account of a step: prompts, their completions, the micro-batches the loss runs on."""
    rows = config.train.batch_size * method.group_size
    return (f"train.batch_size {config.train.batch_size} prompts x group_size {method.group_size} = {rows} completions "
            f"per rank a generation, trained in micro-batches of {method.micro_batch_size or rows}")


def micro_batch_tokens(config: Any, method: GRPOConfig) -> tuple[int, str]:
    """The tokens of one loss forward, for `posttune plan`'s memory estimate: the worst case.

    The loss runs on ``micro_batch_size`` completions at a time (default: the rank's
    ``batch_size x group_size``), each its prompt (the last ``data.max_prompt_len`` tokens) and
    its completion (at most ``max_new_tokens``). Padding-free with ``share_prompt``, the rows go end
    to end and a group's prompt is computed once: a micro-batch takes consecutive rows, so it holds
    the prompts of the groups it touches (``prompts_touched``), not one per row. ``data.max_seq_len``
    bounds nothing here; without ``max_prompt_len`` prompts are kept whole, and the estimate takes
    ``max_seq_len`` for them (the plan's line says so).
    """
    rows = method.micro_batch_size or config.train.batch_size * method.group_size
    count = (f"micro_batch_size {rows}" if method.micro_batch_size else
             f"batch_size {config.train.batch_size} x group_size {method.group_size}")
    prompt = config.data.max_prompt_len
    named = "max_prompt_len"
    if prompt is None:
        prompt, named = config.data.max_seq_len, "prompt"
    whole = ("" if config.data.max_prompt_len is not None else
             f"; prompts taken as max_seq_len {prompt} long: data.max_prompt_len is not set")
    new = method.max_new_tokens
    if method.padding_free and method.share_prompt:
        # a completion after its group's first keeps its prompt's last token (which predicts its first)
        prompts = prompts_touched(rows, method.group_size)
        how = (f"{count} completions x (max_new_tokens {new} + 1) + {prompts} group prompt(s) x ({named} {prompt} - 1)"
               f": each group's prompt once, every row full: the worst case{whole}")
        return rows * (new + 1) + prompts * (prompt - 1), how
    how = f"{count} completions x ({named} {prompt} + max_new_tokens {new}), every row full: the worst case{whole}"
    return rows * (prompt + new), how


def prompts_touched(rows: int, group_size: int) -> int:
    """The most groups ``rows`` consecutive completions span, micro-batches starting at multiples of ``rows``
    in rows ordered group by group: a window starts ``g - gcd(rows, g)`` rows into a group at worst."""
    return (group_size - math.gcd(rows, group_size) + rows - 1) // group_size + 1


def _method(name: str, module: str = "method") -> Any:
    """``posttune_grpo.<module>.<name>``, imported on the first call (importing this package imports no torch)."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"posttune_grpo.{module}"), name)(*args)

    call.__name__ = name
    return call


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="grpo",
        config=GRPOConfig,
        dataset_kind="prompt",
        data=_method("data"),
        loss=_method("loss", "loss"),
        batches=_method("batches"),
        roles=roles,
        setup=_method("setup"),
        evaluate=_method("evaluate", "evaluation"),
        on_step_end=_method("on_step_end"),
        state_dict=_method("state_dict"),
        load_state_dict=_method("load_state_dict"),
        validate=validate,
        description="GRPO: group-normalised policy gradient on generated completions (sync or async on Ray)",
        micro_batch_tokens=micro_batch_tokens,
        batch_text=batch_text,
        plot=("reward",),  # the loss plot's second panel: the mean reward, and the validation reward
        close=_method("close"),
    ))


@hookimpl
def posttune_register_reward_functions(register):
    for reward in (*REWARDS, MODEL_REWARD_FUNCTION):
        register(reward)


@hookimpl
def posttune_register_configs(register):
    for config in configs_in(CONFIGS):
        register(config)
