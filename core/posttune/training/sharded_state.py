"""Resumable checkpoints of a sharded model (FSDP2, TP): torch.distributed.checkpoint (DCP).

    OUTPUT_DIR/checkpoints/step-00000040/
        sharded/           DCP: model and optimizer state, each rank writing its own shards (with
                           trained roles, every trained model's, keyed ``policy.`` and by role name)
        scheduler.pt       LR scheduler state dict        (rank 0, as in state.py)
        rng.pt             torch and Python RNG states
        trainer_state.json step, epoch, data position

DCP stores every tensor by its fully qualified name with its global shape, so a checkpoint
written by N ranks loads into M ranks, or into one process without any plan (DCP reshards):
`get_state_dict`/`set_state_dict` give the model and optimizer states in that
layout for any parallelisation. The directory is written atomically like every checkpoint:
rank 0 opens the temporary directory, every rank writes its shards into it, rank 0 adds the
trainer state and renames it into place once all ranks are done.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from posttune.checkpoint.atomic import atomic_dir
from posttune.session import Session
from posttune.training import distributed

SHARDED = "sharded"


def is_sharded_checkpoint(path: Path) -> bool:
    return (path / SHARDED).is_dir()


def save(session: Session, target: Path, write_rest: Any, replaceable: tuple[str, ...],
         write_each_rank: Any = None) -> None:
    """Every rank: model + optimizer shards into ``target/sharded`` and ``write_each_rank(tmp)``;
    rank 0 then ``write_rest(tmp)``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic_dir(target, replaceable=replaceable)) if distributed.is_main() else None
        shared = [str(tmp) if tmp is not None else None]
        if distributed.active():
            dist.broadcast_object_list(shared, src=0)
        model_state, optim_state = get_state_dict(session.trainable, session.optimizer)
        with _one_process_quiet():
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=Path(shared[0]) / SHARDED,
                     no_dist=not distributed.active())
        if write_each_rank is not None:
            write_each_rank(Path(shared[0]))
        if distributed.active():
            dist.barrier()  # every rank's shards are on disk before rank 0 renames the directory
        if tmp is not None:
            write_rest(tmp)
    if distributed.active():
        dist.barrier()  # the checkpoint is in place on return, on every rank


def load(session: Session, path: Path) -> None:
    """Model and optimizer from ``path/sharded``, resharded to this run's ranks and plans.

    One process without a process group reads the whole tensors (DCP's no-distributed mode).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(session.trainable, session.optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=path / SHARDED, no_dist=not distributed.active())
    set_state_dict(session.trainable, session.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_quiet() -> Any:
    """DCP warns at every save and load without a process group that it assumes one process: that is
    this run's setting (a 2-rank checkpoint resumed in one process), not news to its user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def gather_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors as whole CPU tensors on rank 0 (empty elsewhere); collective.

    Only the adapters travel: the frozen base model is not gathered for a PEFT save.
    """
    from posttune.adapters import adapted_modules
    from posttune.adapters.lora import adapter_parameter_names

    gathered: dict[str, torch.Tensor] = {}
    for name, layer in adapted_modules(model).items():
        for param_name in adapter_parameter_names(layer):
            tensor = distributed.full_value(layer.get_parameter(param_name).detach())
            if distributed.is_main():
                gathered[f"{name}.{param_name}"] = tensor.cpu()
    from posttune.checkpoint.score_head import HEAD, score_labels

    if score_labels(model) is not None:  # a score head trains whole beside the adapters and is saved with them
        tensor = distributed.full_value(model.get_parameter(HEAD).detach())
        if distributed.is_main():
            gathered[HEAD] = tensor.cpu()
    return gathered
