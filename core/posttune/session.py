"""The session: everything one training run holds, filled in composition order.

Plugins receive it in ``apply``, ``data``, ``setup``, ``batches``, ``loss`` and the other
method callbacks. Fields start empty and are set by the stage that owns them; a plugin reads
what earlier stages produced and extends the run only through the typed fields below (the
extension points), never through ad-hoc keys. docs/plugins.md documents every field and
docs/architecture.md the order in which they are filled.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from posttune.config.schema import ModelConfig, RunConfig
    from posttune.descriptors import LossOutput, ModelFamily
    from posttune.plan import Plan

StepContext = Callable[["Session", Any], AbstractContextManager]
"""``(session, batch) -> context manager`` entered around a micro-batch's forward, loss and backward."""


@dataclass(frozen=True)
class LossKernel:
    """How token losses are computed from a model's hidden states (the ``loss``-stage technique).

    ``cross_entropy(model, batch) -> (summed loss, labelled tokens)`` and
    ``logps(model, batch, temperature) -> [batch, seq]`` per-token log-probabilities of the
    labels under ``softmax(logits / temperature)`` (0 where ignored).
    ``posttune.losses.token_cross_entropy`` and ``token_logps`` call these when set.
    ``logps_entropies(model, batch, temperature) -> (logps, entropies)``, optional: the same log-probs and,
    without gradient, the entropy of ``softmax(logits / temperature)`` at each labelled position (0 elsewhere),
    for ``token_logps(..., entropies=True)``; a kernel without it leaves those calls to the plain path.
    """

    cross_entropy: Callable[[Any, dict[str, Any]], tuple[Any, Any]]
    logps: Callable[[Any, dict[str, Any], float], Any]
    name: str = ""
    logps_entropies: Callable[[Any, dict[str, Any], float], tuple[Any, Any]] | None = None


@dataclass(eq=False)
class ModelTarget:
    """One model of the run as the model stages build it: the policy, or another role (frozen or trained).

    Parallel plans and memory techniques receive it in ``apply(session, target)`` and act on
    ``target.model`` (they may replace it). ``family`` is the role's own family (a role may be of
    another family than the policy); ``config`` its model section.
    """

    role: str  # "policy", or the name of a model role the method declared (``ModelRole.name``)
    family: ModelFamily
    config: ModelConfig
    model: torch.nn.Module | None = None
    trainable: bool = False
    score: bool = False  # a score head replaces the logits (``ModelRole.score``, ``Method.score_head``)


@dataclass(eq=False)
class Session:
    # -- the run's inputs ------------------------------------------------------------------------
    config: RunConfig
    plan: Plan
    method_config: Any = None  # the method's validated settings (an instance of ``Method.config``)
    # -- distributed (stage "distributed") ---------------------------------------------------------
    device: torch.device | None = None
    mesh: Any = None  # torch.distributed DeviceMesh, or None on one process
    # -- models (stages build .. load, then the method's roles) -----------------------------------
    tokenizer: Any = None
    model: torch.nn.Module | None = None  # the policy: the model that trains
    models: dict[str, torch.nn.Module] = field(default_factory=dict)  # the method's roles, by role name
    #: every model the optimizer steps: the policy alone, or an ``nn.ModuleDict`` of the policy and the
    #: method's trained roles (``ModelRole.trained``), keyed ``policy`` and by role name
    trainable: torch.nn.Module | None = None
    targets: dict[str, ModelTarget] = field(default_factory=dict)  # every model as the stages built it
    # -- data, steps, optimisation -----------------------------------------------------------------
    train_data: Any = None  # what ``Method.data(session, config.data.train, "train")`` returned
    validation_data: Any = None  # the same for ``data.validation``, or None
    total_steps: int = 0  # optimizer steps of the whole run (fixed after the data stage)
    # ``train.eval_every`` and ``checkpoint.save_every`` in optimizer steps (``epoch`` resolved once data is read)
    eval_every: int | None = None
    save_every: int | None = None
    optimizer: Any = None
    scheduler: Any = None
    step: int = 0  # optimizer steps done
    epoch: int = 0
    resume_from: Path | None = None  # the checkpoint this run resumes from, known before ``method.setup``
    run_id: str = ""  # the lineage this run's checkpoints belong to (inherited on resume), set with resume_from
    skipped_nonfinite: int = 0  # optimizer steps skipped for a NaN/Inf loss or grad norm (train.skip_nonfinite)
    #: the step records since the last one written (``train.log_every``), kept in checkpoints (rank 0's)
    log_window: list[dict[str, Any]] = field(default_factory=list)
    # -- extension points: what plugins add to the run ---------------------------------------------
    #: entered around each micro-batch's forward, loss and backward (loss parallel, context parallel,
    #: sequence padding for TP); run in order
    step_contexts: list[StepContext] = field(default_factory=list)
    #: called with each micro-batch's LossOutput after the forward, before backward (optimizer-in-
    #: backward computes its gradient scale here)
    before_backward: list[Callable[[Session, LossOutput], None]] = field(default_factory=list)
    #: ``(session, params, max_norm) -> total norm``: clips the step's gradients; None: the core's
    #: (plain and DTensor gradients). A technique that consumed the gradients reports their norm instead.
    clip_gradients: Callable[[Session, list, float], Any] | None = None
    #: the ``loss``-stage technique's kernels (chunked cross-entropy), or None for the plain loss
    loss_kernel: LossKernel | None = None
    #: called once before the final save: a technique that trained a stand-in puts the real model back
    before_final_save: list[Callable[[Session], None]] = field(default_factory=list)
    #: the method's own state (precomputed log-probs, a rollout buffer, ...): the method owns it,
    #: and saves what must survive a restart through ``Method.state_dict``
    method_state: Any = None
