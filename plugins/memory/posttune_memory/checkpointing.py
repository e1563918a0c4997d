"""activation_checkpointing: keep only each decoder layer's input, recompute the rest in backward.

A layer's activations (attention and MLP intermediates) are freed after its forward and
rebuilt from the saved input when backward reaches it: activation memory falls from
``layers x per-layer`` to roughly ``layers x one hidden state + one layer``, for about one
extra forward pass of compute. ``memory_options.activation_checkpointing.every: k``
checkpoints only the k-th, 2k-th, ... layers (counting from 1), trading less recompute for
less saving.

Why the layer's ``forward`` is wrapped in place instead of wrapping the module (torch's
``checkpoint_wrapper``): a wrapper module adds ``_checkpoint_wrapped_module`` to every
parameter name, and posttune's loaders, HF/PEFT savers and adapter lookups all go by module
names. Replacing the instance's ``forward`` keeps the module tree, and state-dict names,
unchanged; FSDP2's ``fully_shard`` (applied later, order 100) hooks ``__call__`` and sees the
checkpointed forward like any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttune.plugin import PosttuneError


def decoder_layers(model: nn.Module, technique: str) -> nn.ModuleList:
    """The model's ``layers`` (the native decoder contract), or a one-line refusal."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise PosttuneError(f"memory: {technique} needs a model with decoder layers in `model.layers`; "
                            f"{type(model).__name__} has none")
    return layers


def apply(session: Any, target: Any) -> None:
    every = session.plan.memory_options["activation_checkpointing"].every
    for index, layer in enumerate(decoder_layers(target.model, "activation_checkpointing")):
        if (index + 1) % every == 0:
            checkpoint_layer(layer)


def checkpoint_layer(layer: nn.Module) -> None:
    """Make ``layer`` recompute its forward in backward (a no-op when no gradient is recorded)."""
    layer.forward = checkpointed(layer.forward)
    layer.activation_checkpointed = True


def checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, generation with a KV cache: nothing to save
            return forward(*args, **kwargs)
        # Non-reentrant: works with kwargs and inputs that need no grad, and preserves the RNG
        # state so dropout draws the same mask when the layer is recomputed.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
