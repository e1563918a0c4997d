"""posttune-dpo: direct preference optimisation -- DPO, cDPO (label smoothing), IPO, SimPO, SLiC's hinge,
robust DPO, RPO (an NLL term on the chosen responses), ORPO, EXO, NCA, BCO, SPPO, APO and DiscoPOP -- and KTO,
from unpaired feedback.

    method:
      name: dpo
      loss_type: sigmoid          # sigmoid (DPO) | ipo | simpo | hinge | robust | orpo | ... (docs/dpo.md),
                                  # or a list with loss_weights (MPO: [sigmoid, bco_pair, sft], [0.8, 0.2, 1.0])
      beta: 0.1
      label_smoothing: 0.0        # cDPO: the chance a preference label is wrong (sigmoid, simpo); robust: its flip rate
      simpo_gamma: 0.5            # SimPO's target reward margin (simpo only)
      rpo_alpha: null             # RPO: add alpha x the chosen responses' per-token NLL (not with orpo)
      precompute_reference: false # score every pair with the reference once, then free it
      padding_free: true          # every response its own document of one row; false: padded rows
      share_prompt: true          # padding-free: each pair's prompt computed once for both responses

    method:
      name: kto                   # rows of the dataset format `unpaired`: prompt, completion, label
      beta: 0.1
      desirable_weight: 1.0
      undesirable_weight: 1.0

Written against the public plugin surface only (``posttune.plugin``). Importing this package
does not import torch. The losses are in ``losses.py``, the data, reference and loss wiring
in ``method.py``; KTO's loss in ``kto_losses.py``, its data and wiring in ``kto.py``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from posttune.plugin import ConfigError, DatasetFormat, Method, ModelRole, RunConfig, configs_in, hookimpl

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

CONFIGS = Path(__file__).parent / "configs"


PairLoss = Literal["sigmoid", "ipo", "simpo", "hinge", "robust", "orpo", "sigmoid_norm", "exo_pair", "nca_pair",
                   "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop", "aot", "aot_unpaired"]
#: the term a loss_type list may add to its pair losses: the chosen responses' NLL (rpo_alpha's)
SFT = "sft"
ListedLoss = Literal[(*get_args(PairLoss), SFT)]  # a loss_type list's entries (one Literal: one clear error)


@dataclass(frozen=True)
class DPOConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {  # TRL's DPOConfig -> here
        "precompute_ref_log_probs": "method.precompute_reference", "max_length": "data.max_seq_len",
        "max_prompt_length": "data.max_prompt_len", "ref_model": "models.reference",
        "truncation_mode": "data.max_prompt_len (the prompt's last tokens kept; responses cut on the right)",
        "sync_ref_model": "method.sync_reference_every (the steps between syncs; null: a fixed reference)",
        "ref_model_sync_steps": "method.sync_reference_every", "ref_model_mixup_alpha": "method.sync_reference_alpha",
        "use_weighting": "method.wpo_weights",
        "reference_free": "method.loss_type: simpo or orpo (losses without a reference; DPO against a uniform "
                          "reference is not offered)",
    }
    # DPO's logistic loss, IPO's squared loss, SimPO, SLiC's hinge loss, robust DPO, ORPO, or one of TRL's other
    # pair losses: DPO on mean log-probs, EXO, NCA, BCO, SPPO (hard), APO (zero, down), DiscoPOP, AOT (paired,
    # unpaired: log-ratios matched by rank within each micro-batch) (docs/dpo.md);
    # or a list of them, summed with loss_weights, where sft adds the chosen responses' NLL (MPO: [sigmoid,
    # bco_pair, sft])
    loss_type: PairLoss | list[ListedLoss] = "sigmoid"
    loss_weights: list[float] | None = None  # with a loss_type list: each loss's weight (default: 1 each)
    # strength of the implicit KL to the reference (SimPO: the reward scale, ~2; ORPO: the odds-ratio weight lambda)
    beta: float = 0.1
    # cDPO (sigmoid, simpo, aot, aot_unpaired): probability that a pair's preference label is flipped; robust: the flip
    # rate it corrects; exo_pair: the labels' epsilon (needed, > 0; the paper uses 1e-3)
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5  # SimPO: target margin between the chosen and rejected rewards
    discopop_tau: float = 0.05  # DiscoPOP: the temperature of the blend between its logistic and exponential losses
    # RPO: add alpha x the chosen response's per-token NLL (its mean over the response's tokens) to each pair's loss
    rpo_alpha: float | None = None
    # f-DPO: the divergence to the reference the loss regularises with, its f'(pi / ref) in place of the
    # log-ratios (reverse_kl is DPO's); with the losses on token sums: sigmoid, hinge, robust, exo_pair, discopop
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5  # alpha_divergence's alpha
    # LD-DPO: a response's tokens past the other response's length weighted by this, in [0, 1], in the policy's
    # and the reference's log-probs (the paper's alpha, TRL's ld_alpha; the NLL term is unweighted)
    ld_alpha: float | None = None
    precompute_reference: bool = False  # reference log-probs computed once before training; no reference model
    # WPO: each pair's loss weighted by how likely the policy is to write both responses itself (their
    # length-normalised probabilities, each token's against the policy's own distribution; TRL's use_weighting)
    wpo_weights: bool = False
    # TR-DPO: every this many optimizer steps the reference moves toward the policy, ref <- alpha x policy +
    # (1 - alpha) x ref (TRL's sync_ref_model, ref_model_sync_steps); null: a fixed reference
    sync_reference_every: int | None = None
    sync_reference_alpha: float = 0.6  # TR-DPO's alpha (TRL's ref_model_mixup_alpha); 1: the policy replaces it
    # the batch's responses end to end in one row, each its own document: no padding computed (the
    # padded batch's losses); false: padded rows, 2 x batch_size of them
    padding_free: bool = True
    # padding-free: each pair's prompt computed once, the rejected response attending to the chosen one's
    # copy (the same losses); off under a plan that splits the sequence (context parallelism)
    share_prompt: bool = True


#: the loss types that use no reference model
REFERENCE_FREE: tuple[str, ...] = ("simpo", "orpo")
#: the loss types f-DPO's scores apply to: those on DPO's log-ratio difference of token sums (as TRL's, but for
#: ipo and sigmoid_norm, computed on per-token means here)
F_DIVERGENCE_LOSSES: tuple[str, ...] = ("sigmoid", "hinge", "robust", "exo_pair", "discopop")
#: the loss types that read ``label_smoothing``: cDPO's mixture of both labels, or robust DPO's correction
SMOOTHED: tuple[str, ...] = ("sigmoid", "simpo", "robust", "exo_pair", "aot", "aot_unpaired")


def weighted_losses(config: DPOConfig) -> tuple[tuple[str, float], ...]:
    """``(loss type, weight)`` of each loss the run sums: one of weight 1, or the ``loss_type`` list's."""
    if isinstance(config.loss_type, str):
        return ((config.loss_type, 1.0),)
    weights = config.loss_weights or [1.0] * len(config.loss_type)
    return tuple(zip(config.loss_type, weights, strict=False))


def pair_losses(config: DPOConfig) -> tuple[str, ...]:
    """The run's pair losses (``sft`` is a term on the chosen responses alone), in their order."""
    return tuple(name for name, _ in weighted_losses(config) if name != SFT)


def uses_reference(config: DPOConfig) -> bool:
    return any(name not in REFERENCE_FREE for name in pair_losses(config))


def roles(config: DPOConfig) -> tuple[ModelRole, ...]:
    """A reference model, except for reference-free SimPO and ORPO: by default from the policy's source, and
    with LoRA the policy without its adapters; `models.reference` (or `reference:`) gives another."""
    if not uses_reference(config):
        return ()
    return (ModelRole("reference", from_policy=True, adapters_off=True),)


def validate(config: RunConfig, method: DPOConfig) -> None:
    losses = pair_losses(method)
    shown = method.loss_type if isinstance(method.loss_type, str) else f"[{', '.join(method.loss_type)}]"
    _check_loss_list(method, losses)
    if not (math.isfinite(method.beta) and method.beta > 0):
        raise ConfigError("method.beta", f"expected a positive number, got {method.beta}")
    if not 0.0 <= method.label_smoothing < 0.5:
        raise ConfigError("method.label_smoothing", f"expected a value in [0, 0.5), got {method.label_smoothing}")
    if method.label_smoothing and losses == ("ipo",):
        raise ConfigError("method.label_smoothing", "ipo has no label smoothing (it is a squared loss); "
                                                    "use loss_type sigmoid for cDPO")
    if method.label_smoothing and not set(losses) & set(SMOOTHED):
        raise ConfigError("method.label_smoothing", f"{shown} has no label smoothing; loss types "
                                                    f"{', '.join(SMOOTHED)} use it")
    if "exo_pair" in losses and not method.label_smoothing:
        raise ConfigError("method.label_smoothing", "exo_pair needs it above 0: the labels' epsilon, whose log it "
                                                    "takes (the EXO paper uses 1e-3)")
    if method.simpo_gamma != DPOConfig.simpo_gamma and "simpo" not in losses:
        raise ConfigError("method.simpo_gamma", f"only loss_type simpo uses it (this run: {shown})")
    if method.discopop_tau != DPOConfig.discopop_tau and "discopop" not in losses:
        raise ConfigError("method.discopop_tau", f"only loss_type discopop uses it (this run: {shown})")
    if not (math.isfinite(method.discopop_tau) and method.discopop_tau > 0):
        raise ConfigError("method.discopop_tau", f"expected a positive number, got {method.discopop_tau}")
    if method.rpo_alpha is not None:
        if not (math.isfinite(method.rpo_alpha) and method.rpo_alpha > 0):
            raise ConfigError("method.rpo_alpha", f"expected a positive number (null: no NLL term), "
                                                  f"got {method.rpo_alpha}")
        if "orpo" in losses:
            raise ConfigError("method.rpo_alpha", "orpo already adds the chosen responses' NLL; remove it")
        if len(losses) < len(weighted_losses(method)):
            raise ConfigError("method.rpo_alpha", "loss_type's sft is the same NLL term; keep one of them")
    if "orpo" in losses and len(losses) < len(weighted_losses(method)):
        raise ConfigError("method.loss_type", "orpo already adds the chosen responses' NLL, which sft in the list "
                                              "would add a second time; remove sft")
    if not (math.isfinite(method.simpo_gamma) and method.simpo_gamma >= 0):
        raise ConfigError("method.simpo_gamma", f"expected a margin >= 0, got {method.simpo_gamma}")
    if method.f_divergence_type != "reverse_kl" and not set(losses) <= set(F_DIVERGENCE_LOSSES):
        raise ConfigError("method.f_divergence_type", f"{method.f_divergence_type} replaces the log-ratio "
                                                      f"difference of {', '.join(F_DIVERGENCE_LOSSES)} (this run: "
                                                      f"{shown})")
    if method.f_alpha_divergence_coef != DPOConfig.f_alpha_divergence_coef and \
            method.f_divergence_type != "alpha_divergence":
        raise ConfigError("method.f_alpha_divergence_coef", "only f_divergence_type alpha_divergence uses it")
    if method.ld_alpha is not None and not 0 <= method.ld_alpha <= 1:
        raise ConfigError("method.ld_alpha", f"expected a weight in [0, 1], got {method.ld_alpha}")
    if method.precompute_reference and not uses_reference(method):
        raise ConfigError("method.precompute_reference", f"{shown} uses no reference model; remove it")
    _check_sync(config, method, shown)
    if method.wpo_weights and set(losses) & {"aot", "aot_unpaired"}:
        raise ConfigError("method.wpo_weights", f"{shown} sorts the batch's log-ratios, so a pair's loss is not its "
                                                "own to weight (TRL refuses it too)")
    streaming = [split for split in ("train", "validation")
                 if getattr(config.data, split) is not None and getattr(config.data, split).streaming]
    if method.precompute_reference and streaming:
        raise ConfigError(f"data.{streaming[0]}.streaming", "precompute_reference scores the whole dataset "
                                                            "before training; it needs a map-style dataset")


def _check_sync(config: RunConfig, method: DPOConfig, shown: str) -> None:
    """TR-DPO's settings: a reference of its own (not the policy with its adapters off), scored live."""
    every, alpha = method.sync_reference_every, method.sync_reference_alpha
    if not (math.isfinite(alpha) and 0 < alpha <= 1):
        raise ConfigError("method.sync_reference_alpha", f"expected a weight in (0, 1], got {alpha}")
    if every is None:
        if alpha != DPOConfig.sync_reference_alpha:
            raise ConfigError("method.sync_reference_alpha", "only sync_reference_every uses it (TR-DPO)")
        return
    if every < 1:
        raise ConfigError("method.sync_reference_every", f"expected a number of steps >= 1 (null: a fixed "
                                                         f"reference), got {every}")
    if not uses_reference(method):
        raise ConfigError("method.sync_reference_every", f"{shown} uses no reference model; remove it")
    if method.precompute_reference:
        raise ConfigError("method.precompute_reference", "a reference synced with the policy "
                                                         "(sync_reference_every) changes as it trains; its "
                                                         "log-probs cannot be computed once")
    if config.adapter is not None:
        raise ConfigError("method.sync_reference_every", "with an adapter the reference shares the policy's base "
                                                         "weights; TR-DPO needs a reference of its own (full "
                                                         "fine-tuning, as TRL)")


def _check_loss_list(method: DPOConfig, losses: tuple[str, ...]) -> None:
    """A ``loss_type`` list: distinct losses, at least one of them a pair loss, and a weight for each."""
    if isinstance(method.loss_type, str):
        if method.loss_weights is not None:
            raise ConfigError("method.loss_weights", "weights the losses of a loss_type list; this run has one "
                                                     f"loss ({method.loss_type}): remove it")
        return
    names = method.loss_type
    if not losses:
        raise ConfigError("method.loss_type", f"expected at least one pair loss (sigmoid, ipo, ...), got "
                                              f"[{', '.join(names)}]; sft alone is method sft")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError("method.loss_type", f"{repeated[0]} is listed twice; give it one weight in loss_weights")
    weights = method.loss_weights
    if weights is None:
        return
    if len(weights) != len(names):
        raise ConfigError("method.loss_weights", f"expected one weight per loss_type ({len(names)}), got "
                                                 f"{len(weights)}")
    for index, weight in enumerate(weights):
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"method.loss_weights[{index}]", f"expected a positive number, got {weight}")


def micro_batch_tokens(config: Any, method: DPOConfig) -> tuple[int, str]:
    """The tokens of one micro-batch's forward, for `posttune plan`'s memory estimate: the worst case."""
    from posttune.plugin import pair_tokens

    return pair_tokens(config, padding_free=method.padding_free)


def _method(name: str, module: str = "method") -> Any:
    """``posttune_dpo.<module>.<name>``, imported on the first call (importing this package imports no torch)."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"posttune_dpo.{module}"), name)(*args)

    call.__name__ = name
    return call


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="dpo",
        config=DPOConfig,
        dataset_kind="preference",
        data=_method("data"),
        loss=_method("loss"),
        roles=roles,
        setup=_method("setup"),
        on_step_end=_method("on_step_end"),
        state_dict=_method("state_dict"),
        load_state_dict=_method("load_state_dict"),
        validate=validate,
        description="direct preference optimisation: DPO, cDPO, IPO, SimPO, hinge, robust DPO, RPO, ORPO, AOT, "
                    "TR-DPO; chosen and rejected in one forward",
        micro_batch_tokens=micro_batch_tokens,
    ))
    register(Method(
        name="kto",
        config=KTOConfig,
        dataset_kind="feedback",
        data=_method("data", "kto"),
        loss=_method("loss", "kto"),
        roles=kto_roles,
        validate=kto_validate,
        description="KTO: unpaired desirable/undesirable feedback against a KL reference point (format unpaired)",
        micro_batch_tokens=kto_micro_batch_tokens,
    ))


@dataclass(frozen=True)
class KTOConfig:
    # strength of the implicit KL to the reference: the scale of the log-ratios inside KTO's sigmoid
    beta: float = 0.1
    # weight of each desirable example's loss (the paper's lambda_D)
    desirable_weight: float = 1.0
    # weight of each undesirable example's loss (lambda_U); the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3]
    undesirable_weight: float = 1.0
    # each row's completion and its mismatched pair (the KL estimate's) end to end in one row, each its
    # own document: no padding computed; false: padded rows, 2 x batch_size of them
    padding_free: bool = True
    # padding-free: each row's prompt computed once for its completion and its mismatched pair (the same
    # losses); off under a plan that splits the sequence (context parallelism)
    share_prompt: bool = True


def kto_roles(config: KTOConfig) -> tuple[ModelRole, ...]:
    """The frozen reference, as DPO's: a copy of the policy's source, or the policy without its adapters."""
    return (ModelRole("reference", from_policy=True, adapters_off=True),)


def kto_validate(config: RunConfig, method: KTOConfig) -> None:
    for field in ("beta", "desirable_weight", "undesirable_weight"):
        value = getattr(method, field)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"method.{field}", f"expected a positive number, got {value}")
    if config.train.batch_size < 2:
        # one row would be paired with its own completion: z0 would be the row's own log-ratio (TRL refuses it too)
        raise ConfigError("train.batch_size", f"kto estimates its KL reference point from each row's prompt with "
                                              f"another row's completion; needs at least 2, got "
                                              f"{config.train.batch_size}")


def kto_micro_batch_tokens(config: Any, method: KTOConfig) -> tuple[int, str]:
    """`posttune plan`'s tokens per forward: each row's completion and its mismatched pair, laid out as DPO's
    chosen and rejected responses, so DPO's worst case."""
    from posttune.plugin import pair_tokens

    tokens, how = pair_tokens(config, padding_free=method.padding_free)
    return tokens, how.replace("chosen and rejected in one forward", "each completion and its mismatched pair in "
                                                                     "one forward")


def _unpaired(row: Any) -> Any:
    from posttune_dpo.kto import unpaired

    return unpaired(row)


def _unpaired_text(row: Any) -> Any:
    from posttune_dpo.kto import unpaired_text

    return unpaired_text(row)


@hookimpl
def posttune_register_datasets(register):
    register(DatasetFormat("unpaired", "feedback", _unpaired, ("prompt", "completion", "label"),
                           "unpaired binary feedback (TRL's unpaired preference rows): prompt, completion, label "
                           "(true: desirable)"))
    register(DatasetFormat("unpaired_text", "feedback", _unpaired_text, ("prompt", "completion", "label"),
                           "TRL's standard unpaired rows: prompt and completion as plain text (no chat template), "
                           "label (true: desirable)"))


@hookimpl
def posttune_register_configs(register):
    for config in configs_in(CONFIGS):
        register(config)
