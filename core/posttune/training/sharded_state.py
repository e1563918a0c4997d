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
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from posttune.checkpoint.atomic import atomic_dir
from posttune.errors import PosttuneError
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


def check_shared(out: Path) -> None:
    """Under torchrun, every rank sees the output directory rank 0 holds: checkpoint shards are written by every
    rank into the directory rank 0 names and then renames. On node-local disks each node kept its own shards, and
    rank 0's checkpoint, saved and verified against a manifest of what it could see, lacked the others' and could
    never be resumed. Checked as the process group starts, before the model is built."""
    import socket
    import tempfile

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    main, name = dist.get_rank() == 0, [None]
    if main:
        try:  # a run has claimed the folder by now; a script composing a session itself may not have
            out.mkdir(parents=True, exist_ok=True)
            handle, probe = tempfile.mkstemp(prefix=".posttune-probe-", dir=out)  # a leftover start checks allow
            os.close(handle)
            name = [Path(probe).name]
        except OSError:  # not writable: the first write there says so, naming the path
            pass
    dist.broadcast_object_list(name, src=0)
    if name[0] is None:
        return
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (_sees(out / name[0]), socket.gethostname()))
    if main:
        (out / name[0]).unlink(missing_ok=True)
    blind = [f"rank {rank} ({host})" for rank, (found, host) in enumerate(seen) if not found]
    if blind:
        raise PosttuneError(f"checkpoint.output_dir: {out} is not one folder for every rank: {', '.join(blind[:4])} "
                            f"cannot see what rank 0 ({seen[0][1]}) writes there; every rank writes its shards of "
                            "each checkpoint into it, so put it on a filesystem every node mounts (NFS, Lustre, ...) "
                            "at the same path")


def _sees(path: Path) -> bool:
    """Whether ``path`` is there, looked for a few times over ~4 s: a network filesystem may show another node's
    new file a moment late."""
    import time

    for wait in (0.0, 0.25, 0.5, 1.0, 2.0):
        time.sleep(wait)
        if path.is_file():
            return True
    return False


def missing_shards(path: Path) -> str | None:
    """The first file a sharded checkpoint's ``.metadata`` names that is not there (a checkpoint saved before
    `check_shared`, on node-local disks, or copied without every rank's shards), or None."""
    import torch.distributed.checkpoint as dcp

    if not is_sharded_checkpoint(path) or not (path / SHARDED / ".metadata").is_file():
        return None
    try:
        storage = dcp.FileSystemReader(path / SHARDED).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - whatever it is, the checkpoint cannot be read
        return f"{SHARDED}/.metadata is unreadable ({type(exc).__name__})"
    for info in (storage or {}).values():
        if not (path / SHARDED / info.relative_path).is_file():
            return f"{SHARDED}/{info.relative_path} is missing (written where rank 0 could not see it?)"
    return None


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
    from posttune.adapters.layer import adapter_parameter_names

    gathered: dict[str, torch.Tensor] = {}
    for name, layer in adapted_modules(model).items():
        for param_name in adapter_parameter_names(layer):
            tensor = distributed.full_value(layer.get_parameter(param_name).detach())
            if distributed.is_main():
                gathered[f"{name}.{param_name}"] = tensor.cpu()
    from posttune.checkpoint.score_head import SCORE_HEAD, score_labels

    if score_labels(model) is not None:  # a score head trains whole beside the adapters and is saved with them
        tensor = distributed.full_value(model.get_parameter(SCORE_HEAD).detach())
        if distributed.is_main():
            gathered[SCORE_HEAD] = tensor.cpu()
    return gathered
