"""optimizer_in_backward: each parameter is stepped, and its gradient freed, inside backward.

A normal step keeps every gradient until ``optimizer.step()``: one full copy of the trainable
parameters. Here each trainable parameter gets its own optimizer (same class and settings as
the one the core built), stepped from ``register_post_accumulate_grad_hook`` the moment its
gradient is complete; the gradient is then dropped, so at most the gradients backward is
still producing exist at once.

What that costs, checked before launch (``posttune_memory.validate_optimizer_in_backward``):
no gradient accumulation (a parameter is stepped after every backward) and no clipping by the
global norm (a parameter is stepped before the other gradients exist). Gradients must be
normalised by the global normaliser (tokens, pairs) before they are applied: the technique
adds a ``session.before_backward`` callback that computes the scale (``ranks / normaliser``)
after the forward pass, before backward (with accumulation 1 the count is known there), and
each hook multiplies its finished gradient by it, exactly as the trainer's step would. Its
``session.clip_gradients`` reports the norm the hooks measured (nothing is left to clip).

Sharded models (FSDP2/TP) are refused for now: FSDP2 does call these hooks after its
reduce-scatter, but sharded checkpoints (DCP) expect plain optimizers; not wired yet.

The LR schedule and checkpoints work unchanged: the core's optimizer stays as the holder of
the param groups its scheduler drives (it never steps and holds no state), and the per-
parameter optimizers copy its learning rates after every scheduler step. ``state_dict`` of
both wrappers is what ``posttune.training.state`` saves and restores.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from posttune.plugin import PosttuneError, full_value, is_dtensor, sum_over_token_ranks, token_group


def apply(session: Any, target: Any) -> None:
    if any(is_dtensor(p) for p in session.trainable.parameters()):
        # FSDP2 would call the hooks after its reduce-scatter, but sharded (DCP) checkpoints
        # read a plain optimizer; until that is wired and tested, refuse rather than half-work.
        raise PosttuneError("memory: optimizer_in_backward does not support sharded (FSDP2, TP) models yet; "
                            "drop it or run on one device")
    optimizer = InBackwardOptimizer(session.optimizer, dict(session.trainable.named_parameters()))
    session.optimizer = optimizer
    session.scheduler = InBackwardScheduler(session.scheduler, optimizer)
    session.before_backward.append(optimizer.set_scale)
    session.clip_gradients = lambda _session, _params, _max_norm: optimizer.consumed_grad_norm()


class InBackwardOptimizer:
    """What the trainer and checkpoints see as ``session.optimizer``; the steps happen in hooks."""

    def __init__(self, holder: torch.optim.Optimizer, named: dict[str, torch.nn.Parameter]):
        self.holder = holder  # the core's optimizer: param groups and LRs for the scheduler, no state
        self.grad_scale = 1.0  # set before each backward (``set_scale``)
        names = {id(p): n for n, p in named.items()}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.group_of: dict[str, int] = {}
        for index, group in enumerate(holder.param_groups):
            settings = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                name = names[id(param)]
                self.optimizers[name] = type(holder)([{"params": [param], **settings}])
                self.group_of[name] = index
                param.register_post_accumulate_grad_hook(self._stepper(name))
        self._grad_sq: torch.Tensor | None = None  # on the gradients' device: no host sync per parameter

    def _stepper(self, name: str) -> Any:
        optimizer = self.optimizers[name]

        def step(param: torch.nn.Parameter) -> None:
            grad = param.grad.detach()
            grad.mul_(self.grad_scale)
            norm_sq = full_value(torch.linalg.vector_norm(grad, dtype=torch.float32)).pow(2)
            self._grad_sq = norm_sq if self._grad_sq is None else self._grad_sq + norm_sq
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # the memory this technique exists to free

        return step

    def set_scale(self, session: Any, out: Any) -> None:
        """Before backward: the scale the trainer's step would apply, ``ranks / global normaliser``.

        Summed over the ranks that hold different data, not the world: TP ranks share a batch.
        """
        group_size = token_group(session)[1]
        normaliser = torch.as_tensor(out.normaliser, dtype=torch.float32, device=session.device).clone()
        normaliser = sum_over_token_ranks(normaliser, session)
        self.grad_scale = group_size / max(float(normaliser), 1.0)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.holder.param_groups

    def step(self) -> None:
        """Nothing left to do: every parameter was stepped during backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are already freed; reset the norm the trainer logs for the next step."""
        self._grad_sq = None

    def consumed_grad_norm(self) -> torch.Tensor:
        """The global gradient norm of this step's gradients, measured before each was freed."""
        return torch.zeros((), dtype=torch.float32) if self._grad_sq is None else self._grad_sq.sqrt()

    def sync_lr(self) -> None:
        for name, optimizer in self.optimizers.items():
            group = self.holder.param_groups[self.group_of[name]]
            optimizer.param_groups[0]["lr"] = group["lr"]

    def state_dict(self) -> dict[str, Any]:
        # The holder has no state, but its param groups carry the LRs the scheduler set.
        return {"holder": self.holder.state_dict(),
                "per_parameter": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["per_parameter"]
        missing = sorted(set(self.optimizers) - set(saved))
        if missing:
            raise PosttuneError(f"optimizer_in_backward: the checkpoint has no optimizer state for {missing[0]}"
                                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
        self.holder.load_state_dict(state["holder"])
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(saved[name])
        self.sync_lr()


class InBackwardScheduler:
    """The core's scheduler, driving the holder's LRs, copied to every per-parameter optimizer."""

    def __init__(self, scheduler: Any, optimizer: InBackwardOptimizer):
        self.scheduler = scheduler
        self.optimizer = optimizer
        optimizer.sync_lr()

    def step(self) -> None:
        with warnings.catch_warnings():  # the holder never steps (its parameters were, in backward)
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        self.optimizer.sync_lr()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        self.optimizer.sync_lr()
