"""Small wrappers so the trainer reads the same on one process and on many.

Ranks vs. data-parallel ranks: the plans of a run declare what each mesh dimension splits
(``MeshDim.splits``). The data loaders shard by the dimensions that split the batch (ranks that
split the sequence or weights of one batch read the same rows); token counts and losses are
summed over the ranks that hold different tokens (every dimension that splits anything), which
is also the group over which data-parallel plans average gradients. The functions take the
session: its mesh holds the names, its plan the declarations.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

#: what a mesh dimension may split for its ranks to hold different tokens (descriptors.Splits)
TOKEN_SPLITS: tuple[str, ...] = ("batch", "sequence", "tokens")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def shutdown() -> None:
    """End a finished distributed run: wait for every rank, then tear the process group down.

    A rank that leaves the interpreter with a live gloo group can abort in C++ at exit
    ("terminate called without an active exception", seen once on one rank of a finished TP run
    while rank 0 was still writing); every rank leaving together after the group is gone cannot.
    """
    if active():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End a torchrun rank without the interpreter's teardown, after everything a process does as it exits.

    ``destroy_process_group`` leaves a gloo group alive while a DeviceMesh holds it (the model's DTensors hold the
    mesh), and the group's worker threads drop a finished collective's tensors a moment after it returns. A drop
    that needs the GIL once the interpreter is being torn down ends the thread inside a C++ destructor and the
    process aborts ("terminate called without an active exception", exit -6): one rank in ~5% of finished 2-rank
    runs here, and torchrun then reports the job failed. Only that teardown is skipped: the other non-daemon
    threads are joined, the atexit handlers run and the standard streams are flushed first, as at a normal exit.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing left to flush
            stream.flush()
    os._exit(status)


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over ``group`` (a process group, or None for the whole world) in place."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Maximum over ``group`` (None: the whole world) in place; one process: unchanged."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def summing(group: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that sums a tensor over ``group`` (None: the world), out of place and differentiable:
    the gradient of every rank's use of the sum reaches every rank's input."""
    import torch.distributed._functional_collectives as collectives

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(tensor, "sum", group if group is not None else dist.group.WORLD)

    return reduce


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. the grad norm under FSDP2) as a plain tensor; plain tensors pass through."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# ---- the mesh, by what its dimensions split ---------------------------------------------------

def _dim_names(mesh: Any) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def split_mesh(session: Any, splits: tuple[str, ...]) -> Any:
    """The sub-mesh over the session's mesh dimensions that split one of ``splits`` (flattened to
    one dimension when there are several), or None when there is no mesh or no such dimension."""
    dims = _dims_splitting(session, splits)
    if not dims:
        return None
    return session.mesh[dims[0]] if len(dims) == 1 else flattened(session.mesh, dims)


def _dims_splitting(session: Any, splits: tuple[str, ...]) -> tuple[str, ...]:
    """The session's mesh dimensions, in mesh order, whose declaration splits one of ``splits``."""
    declared = session.plan.mesh_dims if session.mesh is not None else {}
    return tuple(d for d in _dim_names(session.mesh) if declared[d].splits in splits)


def token_mesh(session: Any) -> Any:
    """The sub-mesh of the ranks that hold different tokens (see module docstring), or None: what a
    data-parallel plan shards or averages gradients over."""
    return split_mesh(session, TOKEN_SPLITS)


def splits_sequence(session: Any) -> bool:
    """Whether a mesh dimension of the run splits each row's positions across ranks (context
    parallelism): a batch layout that needs a whole row on one rank checks this."""
    return bool(_dims_splitting(session, ("sequence",)))


def data_rank(session: Any) -> tuple[int, int]:
    """(coordinate, size) of this rank along the dimensions that split the batch: what loaders shard by.

    Without a mesh it is the process's rank in the world (one process: 0 of 1); a mesh where no
    dimension splits the batch (pure tensor parallelism) has one data-parallel rank.
    """
    if session.mesh is None:
        return rank(), world_size()
    sub = split_mesh(session, ("batch",))
    return (sub.get_local_rank(), sub.size()) if sub is not None else (0, 1)


def token_group(session: Any) -> tuple[Any, int]:
    """(process group, size) over which losses and token counts are summed (see module docstring).

    The group is None (the whole world) without a mesh; with a mesh where no dimension splits
    the tokens (every rank has the whole batch) the size is 1 and nothing is summed.
    """
    if session.mesh is None:
        return None, world_size()
    sub = token_mesh(session)
    return (sub.get_group(), sub.size()) if sub is not None else (None, 1)


def sum_over_token_ranks(tensor: torch.Tensor, session: Any) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks that hold different tokens (``token_group``)."""
    group, size = token_group(session)
    return all_reduce_sum(tensor, group) if size > 1 else tensor


def flattened(mesh: Any, dims: tuple[str, ...]) -> Any:
    """The sub-mesh over ``dims`` as one dimension named ``a_b`` (torch creates it once, then reuses it)."""
    return mesh[dims]._flatten("_".join(dims))


# ---- gradients -------------------------------------------------------------------------------

def is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


@torch.no_grad()
def _by_mesh(params: Iterable[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Parameters with gradients, grouped by their gradients' mesh (None for plain tensors):
    torch's foreach ops refuse a mix of tensor kinds."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    return list(groups.values())


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients, a plain tensor, without a host sync.

    Each mesh's gradients get their norm from torch (a DTensor norm needs its ranks' parts
    reduced: ``full_tensor``), and the norms are combined.
    """
    norms = [full_value(torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)).float()
             for group in _by_mesh(params)]
    if not norms:
        return torch.zeros(())
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def scale_gradients(params: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` (one foreach call per mesh)."""
    if factor == 1.0:
        return
    for group in _by_mesh(params):
        torch._foreach_mul_([p.grad for p in group], factor)


# ---- contexts around a micro-batch's loss and backward -------------------------------------

@contextlib.contextmanager
def step_context(session: Any, batch: Any) -> Iterator[None]:
    """Enter ``session.step_contexts`` around a micro-batch's forward, loss and backward.

    torch's vocabulary- and context-parallel contexts must wrap both; parallel plans append
    their context makers in ``apply``.
    """
    with contextlib.ExitStack() as stack:
        for make in session.step_contexts:
            stack.enter_context(make(session, batch))
        yield


#: how padding extends each [batch, seq] tensor of a micro-batch: a fill value, or a rule
PAD_RULES: dict[str, Any] = {"input_ids": 0, "labels": -100, "document_ids": "new_document", "positions": "continue",
                             "real_tokens": False}


@contextlib.contextmanager
def padded_sequence(batch: Any, multiple: int) -> Iterator[None]:
    """Right-pad the micro-batch (in place) to a sequence length divisible by ``multiple``.

    For plans that split the sequence into equal parts (sequence parallelism, context
    parallelism). Padding changes no loss: its labels are ignored, it sits after every real
    token (causal attention never looks ahead) and, in a packed row, it is its own document.
    """
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        length = batch["input_ids"].shape[1]
        extra = -length % multiple
        if extra:
            for key, value in list(batch.items()):
                if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
                    rule = PAD_RULES.get(key, 0)
                    if key == "positions" and "document_ids" in batch:  # the padding is a document of its own
                        rule = "restart"
                    batch[key] = _pad(value, extra, rule)
    yield


def _pad(value: torch.Tensor, extra: int, rule: Any) -> torch.Tensor:
    last = value[:, -1:]
    if rule == "new_document":
        tail = (last + 1).expand(-1, extra)
    elif rule == "continue":
        tail = last + torch.arange(1, extra + 1, device=value.device)
    elif rule == "restart":
        tail = torch.arange(extra, device=value.device).expand(value.shape[0], -1)
    else:
        tail = torch.full((value.shape[0], extra), rule, dtype=value.dtype, device=value.device)
    return torch.cat([value, tail], dim=1)


def to_device(batch: Any, device: torch.device | None) -> Any:
    """Tensors of a (nested) batch on ``device``; other values as they are."""
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


# ---- gathering a sharded model -------------------------------------------------------------

def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor (FSDP2, TP): saving then needs every rank."""
    return any(is_dtensor(p) for p in model.parameters())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state as plain CPU tensors on rank 0 (an empty dict elsewhere).

    Collective: every rank calls it. Uses torch's own ``get_model_state_dict``, which gathers
    FSDP2 and TP shards one tensor at a time.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # gathering a shard split over two mesh dimensions: torch's caution (a warning, or in torch 2.13 a log record of
    # its redistribute module), which the gathered weights' tests answer (tests/distributed: equal to one
    # process's), not news to the user
    caution = "While redistributing from"
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    def quiet(record: logging.LogRecord) -> bool:
        return caution not in record.getMessage()

    logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", caution)
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    finally:
        logger.removeFilter(quiet)


def paired_shards(target: torch.nn.Module, source: torch.nn.Module,
                  field: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, ``target``'s tensor, ``source``'s tensor) for every weight of two models of one shape, each rank's
    local shards where the plans sharded them: what a method reads to move a model toward another, weight by
    weight, with no gather (a frozen model moved toward the trained one every few steps). FSDP2 modules are
    resharded first (a root stays gathered after its forward). Weights that do not pair (a missing name, another
    shape or sharding) are refused in one line naming ``field``."""
    from torch.distributed.fsdp import FSDPModule

    from posttune.errors import ConfigError

    for model in (target, source):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    sources, pairs = dict(source.named_parameters()), []
    for name, weight in target.named_parameters():
        other = sources.pop(name, None)
        layout = (getattr(weight, "placements", None), getattr(other, "placements", None))
        if other is None or other.shape != weight.shape or layout[0] != layout[1]:
            why = "has no such weight" if other is None else (
                f"holds it as {tuple(other.shape)}, {layout[1] or 'whole'}; this one as {tuple(weight.shape)}, "
                f"{layout[0] or 'whole'}")
            raise ConfigError(field, f"{name}: the other model {why}; the models must hold the same weights alike")
        pairs.append((name, *(w.to_local() if is_dtensor(w) else w for w in (weight, other))))
    if sources:
        raise ConfigError(field, f"{next(iter(sources))}: only one of the models holds it; the models must hold the "
                                 "same weights alike")
    return pairs
