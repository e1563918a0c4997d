"""Resumable checkpoints: the model (HF format, or a PEFT adapter) plus the trainer's state.

    OUTPUT_DIR/checkpoints/step-00000040/
        model/             HF checkpoint (full fine-tuning) or PEFT adapter (LoRA/DoRA)
        models/<role>/     the same for each trained model role (``ModelRole.trained``, e.g. a value model)
        optimizer.pt       optimizer state dict
        scheduler.pt       LR scheduler state dict
        rng.pt             torch and Python RNG states
        method-00000.pt    the method's own state, when it keeps one (``Method.state_dict``): one
                           file per rank (rollouts waiting to be trained on are a rank's own)
        trainer_state.json step, epoch, data position, the run id of the lineage, skipped steps
        manifest.json      every other file's size and sha256, written last (``manifest.py``)

A sharded model (FSDP2, TP: DTensor parameters) writes ``sharded/`` (model and optimizer
through torch.distributed.checkpoint, see ``sharded_state.py``) instead of ``model/`` and
``optimizer.pt``; it resumes on any number of ranks, or on one process.

Each checkpoint directory is written atomically (temp dir, fsync, rename), so one killed at
any instant leaves only complete checkpoints behind. Pruning and `resume: latest` consider only
the checkpoints of this run's lineage (its run id, ``output_dir.py``); `resume: latest` takes
the newest one that matches its manifest and warns about each damaged one it skips.
Everything is read back with safetensors or ``torch.load(weights_only=True)``: no unpickling
of arbitrary objects.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from posttune.checkpoint.atomic import atomic_dir
from posttune.errors import PosttuneError
from posttune.session import Session
from posttune.training import distributed, nonfinite, resume_identity
from posttune.training.manifest import MANIFEST, damage, write_manifest
from posttune.training.resume_identity import IDENTITY
from posttune.training.run_report import CONFIG_FILE, resolved_config
from posttune.training.output_dir import (CHECKPOINTS, LATEST, STATE_FILE, json_field, lineage, named_checkpoint,
                                          new_run_id, recorded_run_id, run_id_of)
from posttune.training.write_errors import torch_write_failed, writing

METHOD_FILE = "method-{rank:05d}.pt"


def model_dir(role: str) -> str:
    """Where a checkpoint keeps a trained model's weights: ``model`` for the policy, ``models/<role>`` else."""
    return "model" if role == "policy" else f"models/{role}"


def trained_models(session: Session) -> dict[str, torch.nn.Module]:
    """Every model the optimizer steps, by role: the policy first, then the method's trained roles."""
    trainable = session.trainable
    return dict(trainable.items()) if isinstance(trainable, torch.nn.ModuleDict) else {"policy": trainable}


def checkpoint_root(session: Session) -> Path:
    return Path(session.config.checkpoint.output_dir) / CHECKPOINTS


def save_checkpoint(session: Session) -> Path:
    """Write step ``session.step``'s checkpoint; return its path (the trainer's probation prunes).

    Every rank calls it; a sharded model is written by all ranks, anything else by rank 0.
    Weights that hold NaN or Inf are refused before anything is written.
    """
    target = checkpoint_root(session) / f"step-{session.step:08d}"
    nonfinite.check_weights(session, f"checkpoint {target}")
    with writing(target, "checkpoint"):
        _write_checkpoint(session, target)
    return target


def _write_checkpoint(session: Session, target: Path) -> None:

    method = session.plan.method.descriptor

    def write_method_state(tmp: Path) -> None:  # every rank, its own file; None: nothing to keep this time
        state = None if method.state_dict is None else method.state_dict(session)
        if state is not None:
            save_torch(state, tmp / METHOD_FILE.format(rank=distributed.rank()))

    def write_trainer_state(tmp: Path) -> None:  # rank 0, last: every other file is in place
        save_torch(session.scheduler.state_dict(), tmp / "scheduler.pt")
        save_torch(rng_state(), tmp / "rng.pt")
        data = session.train_data.state_dict() if hasattr(session.train_data, "state_dict") else None
        (tmp / STATE_FILE).write_text(json.dumps({"step": session.step, "epoch": session.epoch, "data": data,
                                                  "run_id": session.run_id,
                                                  "skipped_nonfinite": session.skipped_nonfinite,
                                                  "log_window": session.log_window,
                                                  "lr": session.config.train.lr, "manifest": MANIFEST,
                                                  IDENTITY: resume_identity.of(session.plan)}, indent=2))
        # the config this step trained under: a resume names what changed since it (run_report.save_config)
        (tmp / CONFIG_FILE).write_text(yaml.safe_dump(resolved_config(session.plan), sort_keys=False))
        write_manifest(tmp)

    if distributed.is_sharded(session.model):
        from posttune.training import sharded_state

        sharded_state.save(session, target, write_trainer_state, replaceable=(STATE_FILE, MANIFEST),
                           write_each_rank=write_method_state)
    elif distributed.is_main():
        with atomic_dir(target, replaceable=(STATE_FILE, MANIFEST)) as tmp:
            for role, model in trained_models(session).items():
                save_model_or_adapter(session, tmp / model_dir(role), model)
            save_torch(session.optimizer.state_dict(), tmp / "optimizer.pt")
            write_method_state(tmp)
            write_trainer_state(tmp)


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save``, whose failed write becomes an OSError naming the file (``writing`` reports it)."""
    try:
        torch.save(obj, path)
    except RuntimeError as exc:
        raise torch_write_failed(exc, path) from None


def save_model_or_adapter(session: Session, directory: Path, model: torch.nn.Module | None = None) -> Path:
    """``model`` (the policy by default) as the run trains it: a PEFT adapter with LoRA/DoRA, else the
    full HF checkpoint.

    A sharded model (FSDP2, TP) is gathered to rank 0 first, so every rank must call this
    (collective); only rank 0 writes. A whole model on every rank (a plan that replicates it) is
    written by rank 0 alone too: ranks writing one directory at once would race for its rename.
    """
    model = session.model if model is None else model
    from posttune.checkpoint.score_head import PolicyHead, save_policy_head

    if isinstance(model, PolicyHead):  # a head on the policy: its own small file, whatever the run trains
        state = distributed.full_state_dict(model) if distributed.is_sharded(model) else None
        return save_policy_head(model, directory, state) if distributed.is_main() else Path(directory)
    gathered = None
    if distributed.is_sharded(model):
        from posttune.training.sharded_state import gather_adapters

        gathered = (gather_adapters(model) if session.config.adapter is not None
                    else distributed.full_state_dict(model))
    if not distributed.is_main():
        return Path(directory)
    if session.config.adapter is not None:
        from posttune.adapters import save_adapter

        return save_adapter(model, directory, state_dict=gathered, tokenizer=session.tokenizer)
    from posttune.checkpoint.hf_save import save_hf

    return save_hf(model, directory, tokenizer=session.tokenizer, state_dict=gathered)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_resume(session: Session) -> tuple[Path | None, str]:
    """The checkpoint ``checkpoint.resume`` names and the run id of this run's lineage.

    ``latest``: the newest intact checkpoint of the lineage ``run.json`` names (None if there
    is none yet); a path: that checkpoint, which must be intact. A fresh run starts a new
    lineage; a resumed one inherits its checkpoint's. Rank 0 decides (it reads and verifies
    the files) and tells the other ranks.
    """
    found: list[Any] = [None, ""]
    if distributed.is_main():
        path, run_id = _choose_resume(session)
        found = [str(path) if path is not None else None, run_id]
    if distributed.active():
        import torch.distributed as dist

        dist.broadcast_object_list(found, src=0)
    return (Path(found[0]) if found[0] is not None else None), found[1]


def _choose_resume(session: Session) -> tuple[Path | None, str]:
    resume = session.config.checkpoint.resume
    if resume is None:
        return None, new_run_id()
    if resume == LATEST:
        recorded = recorded_run_id(Path(session.config.checkpoint.output_dir))
        for path in reversed(lineage(checkpoint_root(session), recorded, unreadable=True)):
            problem = checkpoint_damage(path)
            if problem is None:
                return path, recorded or run_id_of(path) or new_run_id()
            print(f"posttune: warning: checkpoint.resume: skipping damaged checkpoint {path} ({problem})",
                  file=sys.stderr)
        return None, recorded or new_run_id()
    path = named_checkpoint(resume)  # one that does not exist (or `last` for `latest`) is refused
    if not (path / STATE_FILE).is_file():
        raise PosttuneError(f"checkpoint.resume: {path} is not a posttune checkpoint (no {STATE_FILE})")
    problem = checkpoint_damage(path)
    if problem is not None:
        raise PosttuneError(f"checkpoint.resume: {path} is damaged ({problem}); name another checkpoint or use "
                            "checkpoint.resume=latest")
    return path, run_id_of(path) or new_run_id()


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` (against its manifest), or None."""
    problem = damage(path)
    if problem is None and run_id_of(path) is None:
        problem = f"{STATE_FILE} is unreadable"
    # older checkpoints have no manifest, accepted unverified; one written with a manifest that lost it is not
    if problem is None and not (path / MANIFEST).is_file() and json_field(path / STATE_FILE, "manifest") == MANIFEST:
        problem = f"{MANIFEST} is missing (the checkpoint was written with one: its files cannot be verified)"
    if problem is None:
        from posttune.training.sharded_state import missing_shards

        problem = missing_shards(path)
    return problem


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """An unsharded run's optimizer state resumed under a sharding plan (FSDP2, TP): each parameter's whole state
    tensors (Adam's moments) cut to this rank's shard, as its parameter is (every rank read the same file, so
    no communication). The weights took their shards as they loaded (``copy_into``)."""
    from posttune.checkpoint.materialize import copy_into

    held = getattr(optimizer, "state", None)  # None: an optimizer of optimizers (in backward) keeps its own
    for group in getattr(optimizer, "param_groups", []) if held is not None else []:
        for param in group["params"]:
            state = held.get(param, {})
            for key, value in state.items():
                if getattr(param, "device_mesh", None) is not None and torch.is_tensor(value) \
                        and getattr(value, "device_mesh", None) is None and value.shape == param.shape:
                    state[key] = torch.empty_like(param, dtype=value.dtype)
                    copy_into(state[key], value)


def load_trainer_state(session: Session, path: Path) -> None:
    """Restore optimizer, scheduler, RNG, data position and step from checkpoint ``path``."""
    meta = json.loads((path / STATE_FILE).read_text())
    from posttune.training import sharded_state

    if sharded_state.is_sharded_checkpoint(path):  # written by ranks with a sharded model: any layout reads it
        sharded_state.load(session, path)
    else:
        # on the CPU: load_state_dict moves each state to its parameter's device (rank r's, not cuda:0 where it was
        # saved; and a GPU run's checkpoint resumes on a machine without one)
        try:
            session.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
        except ValueError as exc:  # torch's "... parameter group that doesn't match the size of optimizer's group"
            raise PosttuneError(f"cannot resume {path}: its optimizer state is for other trainable parameters than "
                                f"this run's ({exc}); the settings that choose them (adapter, memory techniques that "
                                "freeze or add weights) changed: resume with the checkpoint's, or start a new run "
                                "from its model") from None
        shard_optimizer_state(session.optimizer)
    session.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True, map_location="cpu"))
    from posttune.training.optim import resync_lr

    resync_lr(session.optimizer, session.scheduler)  # a longer run's schedule, at the restored step
    saved_lr, lr = meta.get("lr"), session.config.train.lr
    if isinstance(saved_lr, (int, float)) and saved_lr > 0 and saved_lr != lr:  # train.lr changed: it applies
        from posttune.training.optim import rescale_lr

        rescale_lr(session.optimizer, session.scheduler, lr / saved_lr)
    if meta.get("data") is not None and hasattr(session.train_data, "load_state_dict"):
        session.train_data.load_state_dict(meta["data"])
    method = session.plan.method.descriptor
    if method.load_state_dict is not None:
        mine = path / METHOD_FILE.format(rank=distributed.rank())
        saved = len(list(path.glob(METHOD_FILE.replace("{rank:05d}", "*"))))
        if saved and not mine.is_file():
            raise PosttuneError(f"checkpoint.resume: {path} has no {mine.name}, where method '{method.name}' keeps "
                                f"this rank's state; it was saved by {saved} process(es) and this run has "
                                f"{distributed.world_size()}: resume with the same number of processes")
        if saved:  # none: the method kept nothing (its state_dict returned None)
            method.load_state_dict(session, torch.load(mine, weights_only=True))
    session.step = meta["step"]
    # A step that ended an epoch with a partial accumulation was saved after the loader had moved on to the next
    # epoch, before the loop counted it: the loader's epoch is the one to continue (else it is trained twice).
    loader_epoch = (meta.get("data") or {}).get("epoch") if isinstance(meta.get("data"), dict) else None
    session.epoch = max(meta["epoch"], loader_epoch) if isinstance(loader_epoch, int) else meta["epoch"]
    session.skipped_nonfinite = int(meta.get("skipped_nonfinite", 0))
    session.log_window[:] = meta.get("log_window", [])  # the steps a log_every record will average in
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
