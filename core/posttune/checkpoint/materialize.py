"""Build a family's model without touching memory, then give it real (uninitialised) storage.

Loading builds on the meta device (shapes only), allocates each parameter once with
``to_empty`` and copies checkpoint tensors into that storage, so the weights never exist
twice. ``to_empty`` gives every parameter slot its own storage, which silently unties tied
weights (embedding and output head); the tie groups are recorded first and restored after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from posttune.config.dtypes import torch_name
from posttune.errors import PosttuneError

FALLBACK_DTYPE = torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, hf_config: Mapping[str, Any] | None = None) -> torch.dtype:
    """The dtype to build in: the one asked for; else the checkpoint's own; else float32.

    The checkpoint's own dtype (``dtype``, or the older ``torch_dtype``, in config.json) is
    the default because it is what the weights are stored in: loading bf16 weights as bf16
    costs no conversion and no extra memory (transformers 5 does the same; its "auto").
    A config without one means float32, the dtype transformers 4 built in by default.
    """
    if dtype in (None, "auto") and hf_config is not None:
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if dtype in (None, "auto"):
        return FALLBACK_DTYPE
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, torch_name(str(dtype)).removeprefix("torch."), None)  # bf16 == bfloat16
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise PosttuneError(f"dtype: expected a floating-point torch dtype such as 'bfloat16', got {dtype!r}")
    return found


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created inside (parameters, buffers) default to ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(build_fn: Callable[..., nn.Module], kwargs: Mapping[str, Any], dtype: torch.dtype,
          device: torch.device | str) -> nn.Module:
    """``build_fn(**kwargs)`` with its tensors created on ``device`` in ``dtype``."""
    skip = no_random_init() if torch.device(device).type == "meta" else contextlib.nullcontext()
    with torch.device(device), default_dtype(dtype), skip:
        return build_fn(**kwargs)


_RANDOM_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def no_random_init() -> Iterator[None]:
    """``torch.nn.init``'s random fills as no-ops. On the meta device they compute nothing, yet a meta
    ``normal_`` imports torch._dynamo (1-2 s, through a lazily compiled reference op): every
    `posttune generate` paid that for a model that is loaded, not initialised."""
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS if hasattr(torch.nn.init, name)}
    for name in saved:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def tie_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names that share one Parameter object, first name first."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _empty(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``Module.to_empty``'s fill, without ``empty_like`` on plain meta tensors: that computes their
    strides through torch's symbolic shapes, whose first import (sympy) cost ~0.3 s of every `posttune
    generate`. Plain contiguous parameters get the same tensor from ``torch.empty`` of the shape; a
    tensor subclass (a DTensor shard) keeps ``empty_like``, which knows its layout."""
    if type(tensor) in (torch.Tensor, nn.Parameter) and tensor.is_contiguous():
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return torch.empty_like(tensor, device=device)


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a meta model uninitialised storage on ``device``, keeping tied weights tied."""
    groups = tie_groups(model)
    model._apply(lambda tensor: _empty(tensor, device))
    retie(model, groups)
    return model


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Every name of each tied group holds its first name's parameter again."""
    for first, *rest in groups:
        shared = model.get_parameter(first)
        for name in rest:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def init_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (rotary tables...), which ``to_empty`` left as garbage."""
    from posttune.modules import init_buffers as init_all

    init_all(model)


@torch.no_grad()
def copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full tensor into a parameter; a DTensor parameter takes its own shard of it.

    Every rank reads the same file, so the shard is cut locally (``src_data_rank=None``): no
    communication, and never more than one full tensor per process.
    """
    target.copy_(_placed_like(target, value))


def _placed_like(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A full tensor as ``target`` holds it: a DTensor's own shard of it, cut locally."""
    mesh = getattr(target, "device_mesh", None)
    if mesh is None:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(device=target.device, dtype=target.dtype), mesh, target.placements,
                             src_data_rank=None)


def holds(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``target`` (a DTensor: its own shard) already holds a full tensor as ``copy_into`` would put it."""
    placed = _placed_like(target, value)
    if getattr(target, "device_mesh", None) is not None:
        return torch.equal(target.to_local(), placed.to_local())
    return torch.equal(target, placed.to(device=target.device, dtype=target.dtype))
