"""Turn a resolved Plan into a ready Session, one stage at a time, in the documented order.

    distributed -> tokenizer -> build (meta device) -> adapt -> quantize -> parallelize
    -> load (materialise; stream weights or initialise) -> optimizer -> data -> method.setup
    -> resume

Each stage first does the core's part, then runs the memory techniques registered for it
(``parallelize`` interleaves them with parallel plans by ``order``). Nothing here knows a
family, method or plan by name.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttune.checkpoint import materialize as mat
from posttune.checkpoint.origin import ModelOrigin, attach
from posttune.errors import ConfigError
from posttune.plan import Plan
from posttune.registry import Registered
from posttune.session import Session
from posttune.training import distributed, state
from posttune.training.metrics import read_metrics
from posttune.training.optim import build_optimizer, build_scheduler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INIT_STD = 0.02  # random initialisation of Linear and Embedding weights, as HF's LLM configs use


def compose(plan: Plan) -> Session:
    session = Session(plan.config, plan, method_config=plan.method_config, state={"epoch": 0})
    init_distributed(session)
    seed_everything(plan.config.train.seed)
    session.tokenizer = load_tokenizer(session)
    session.model = build_model(session)
    run_stage(session, "build")
    if plan.config.adapter is not None:
        inject_adapters(session)
    run_stage(session, "adapt")
    run_stage(session, "quantize")
    run_stage(session, "parallelize")
    resume_from = state.find_resume(session)
    load_weights(session, resume_from)
    run_stage(session, "load")
    build_data(session)
    session.optimizer = build_optimizer(session.model.named_parameters(), plan.config.train)
    session.state["total_steps"] = total_steps(session)
    session.scheduler = build_scheduler(session.optimizer, plan.config.train, session.state["total_steps"])
    run_stage(session, "optimizer")
    run_stage(session, "loss")
    plan.method.descriptor.setup(session)
    if resume_from is not None:
        state.load_trainer_state(session, resume_from)
        trim_metrics(session)
    return session


def init_distributed(session: Session) -> None:
    """Pick the device; under torchrun, join the process group and build the DeviceMesh."""
    wanted = session.config.train.device
    cuda = torch.cuda.is_available() if wanted == "auto" else wanted.startswith("cuda")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        session.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(session.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        dims = session.plan.mesh
        session.mesh = init_device_mesh(session.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    else:
        session.device = torch.device("cuda" if cuda else "cpu") if wanted == "auto" else torch.device(wanted)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_tokenizer(session: Session) -> Any:
    from posttune.tokenizer import load_tokenizer as load

    path = session.config.tokenizer.path or session.config.model.path
    if path is None:
        raise ConfigError("tokenizer.path", "required when the model is built from a size (no model.path)")
    return load(path)


def build_model(session: Session) -> nn.Module:
    """The family's model on the meta device: no memory is spent until the ``load`` stage."""
    config, family = session.config.model, session.plan.family.descriptor
    if config.path is not None:
        from posttune.checkpoint.source import local_dir, read_hf_config

        hf_config = read_hf_config(local_dir(config.path))
        kwargs = {**family.from_hf_config(hf_config), **config.build_overrides}
    else:
        hf_config, kwargs = None, {**family.sizes[config.size], **config.build_overrides}
    model = mat.build(family.build, kwargs, DTYPES[config.dtype], "meta")
    attach(model, ModelOrigin(family.name, kwargs, hf_config, source=config.path))
    return model


def inject_adapters(session: Session) -> None:
    from posttune.adapters import apply_adapters

    adapter = session.config.adapter
    targets = adapter.targets or list(session.plan.family.descriptor.lora_targets)
    if not targets:
        raise ConfigError("adapter.targets", f"family '{session.plan.family.descriptor.name}' names no default "
                                             "targets; list module-name patterns")
    apply_adapters(session.model, targets=targets, rank=adapter.rank, alpha=adapter.alpha,
                   dropout=adapter.dropout, kind=adapter.kind)


def run_stage(session: Session, stage: str) -> None:
    """Apply the plans and memory techniques of ``stage`` by their ``order``."""
    items: list[Registered] = [m for m in session.plan.memory if m.descriptor.stage == stage]
    if stage == "parallelize":
        items += session.plan.parallel
    for item in sorted(items, key=lambda r: r.descriptor.order):
        item.descriptor.apply(session)


def load_weights(session: Session, resume_from: Path | None) -> None:
    """Materialise the model and fill it: checkpoint weights, or a seeded random initialisation."""
    model, config = session.model, session.config
    # A plan may keep parameters elsewhere (FSDP2 CPU offload: "init_device" is "cpu").
    mat.materialize(model, session.state.get("init_device", session.device))
    # Full fine-tuning resumes its own weights; a sharded checkpoint restores them later, with the
    # optimizer (state.load_trainer_state), so the model starts from its usual source here.
    resumes_hf = resume_from is not None and (resume_from / "model").is_dir()
    if resumes_hf and config.adapter is None:
        source: str | None = str(resume_from / "model")
    else:
        source = config.model.path
    if source is None:
        random_init(model, config.train.seed)
    else:
        from posttune.checkpoint.hf_load import load_into

        load_into(model, source, family=session.plan.family.descriptor.name)
    from posttune.modules import init_buffers

    init_buffers(model)
    if config.adapter is not None:
        from posttune.adapters import init_adapters, load_peft_adapter

        init_adapters(model)
        if resumes_hf:
            load_peft_adapter(model, resume_from / "model")
    model.train()


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """Linear and Embedding weights ~ N(0, 0.02), biases 0, norms their own reset; seeded.

    Every rank draws the same full tensors and a sharded (DTensor) weight keeps its own shard,
    so a sharded model starts exactly where the single-process one does.
    """
    from posttune.checkpoint.hf_load import copy_into

    generator = torch.Generator(device="cpu").manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            weight = module.weight
            copy_into(weight, torch.randn(weight.shape, generator=generator, dtype=torch.float32) * INIT_STD)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif callable(getattr(module, "reset_parameters", None)) and not list(module.children()):
            module.reset_parameters()


def build_data(session: Session) -> None:
    from posttune.data import build_sft_loader

    data, train = session.config.data, session.config.train
    # Shard by the data-parallel coordinate: the TP/CP ranks of one data-parallel group read the same batch.
    rank, world = distributed.data_rank(session.mesh)
    kwargs = dict(data=data, tokenizer=session.tokenizer, seed=train.seed, rank=rank, world_size=world,
                  train_on_input=getattr(session.method_config, "train_on_input", False))
    session.train_data = build_sft_loader(data.train, fmt=session.plan.datasets["train"].descriptor,
                                          batch_size=train.batch_size, where="data.train", **kwargs)
    if data.validation is not None:
        session.validation_data = build_sft_loader(data.validation, fmt=session.plan.datasets["validation"].descriptor,
                                                   batch_size=train.batch_size, where="data.validation",
                                                   shuffle=False, **kwargs)


def total_steps(session: Session) -> int:
    train = session.config.train
    if train.max_steps is not None:
        return train.max_steps
    try:
        per_epoch = math.ceil(len(session.train_data) / train.grad_accum_steps)
    except TypeError:
        raise ConfigError("train.max_steps", "required with streaming data (the epoch length is unknown)") from None
    return train.epochs * per_epoch


def trim_metrics(session: Session) -> None:
    """Drop metric lines past the resumed step: a killed run may have logged steps it never saved."""
    path = Path(session.config.checkpoint.output_dir) / "metrics.jsonl"
    if distributed.is_main() and path.is_file():
        import json

        kept = [r for r in read_metrics(path.parent) if r.get("step", 0) <= session.step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
