"""Turn a resolved Plan into a ready Session, one stage at a time, in the documented order.

    distributed -> tokenizer
    -> policy: build (meta device) -> adapt -> quantize -> parallelize -> load
    -> model roles the method declares: build -> quantize -> parallelize -> load, frozen; or
       the policy with its adapters disabled; or trained: every stage, as the policy
    -> data: method.data(session, dataset, split) for train and validation
    -> step count -> optimizer, LR schedule -> ``optimizer`` and ``loss`` techniques
    -> method.setup -> resume

Each model stage first does the core's part, then runs the memory techniques registered for
it (``parallelize`` interleaves them with parallel plans by ``order``); a frozen role gets only
those whose ``frozen`` is ``"apply"``. Nothing here knows a family, method or plan by name.
docs/architecture.md walks through the same order.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttune.checkpoint import materialize as mat
from posttune.checkpoint.origin import ModelOrigin, attach
from posttune.checkpoint.score_head import add_score_head, checkpoint_labels
from posttune.checkpoint.source import is_hub_id, no_directory
from posttune.config.requires import device_for
from posttune.config.schema import FP16_TRAINING, DataConfig
from posttune.errors import ConfigError, PluginError, PosttuneError, first_line
from posttune.plan import Plan, applies_to_frozen, build_kwargs
from posttune.registry import Registered
from posttune.session import ModelTarget, Session
from posttune.training import distributed, resume_identity, state
from posttune.training.metrics import read_metrics
from posttune.training.optim import build_optimizer, build_scheduler
from posttune.training.output_dir import check_resume_step, record_run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INIT_STD = 0.02  # random initialisation of Linear and Embedding weights, as HF's LLM configs use


def compose(plan: Plan) -> Session:
    session = Session(plan.config, plan, method_config=plan.method_config)
    method = plan.method.descriptor
    init_distributed(session)
    seed_everything(plan.config.train.seed)
    session.tokenizer = load_tokenizer(session)
    session.resume_from, session.run_id = state.find_resume(session)
    resume_identity.check(plan, session.resume_from)  # before anything is written or loaded
    check_resume_step(plan.config, session.resume_from)  # past train.max_steps: likewise
    if distributed.is_main():  # the lineage a later `resume: latest` in this directory follows
        record_run(Path(plan.config.checkpoint.output_dir), session.run_id, session.resume_from)
    build_policy(session)
    build_roles(session)
    build_data(session)
    session.total_steps = total_steps(session)
    set_cadence(session)
    check_resume_step(plan.config, session.resume_from, session.total_steps)  # past train.epochs: before config.yaml
    adapter = plan.config.adapter
    session.optimizer = build_optimizer(session.trainable.named_parameters(), plan.config.train,
                                        loraplus_lr_ratio=adapter.loraplus_lr_ratio if adapter is not None else None)
    session.scheduler = build_scheduler(session.optimizer, plan.config.train, session.total_steps)
    policy = session.targets["policy"]
    run_stage(session, "optimizer", policy)
    run_stage(session, "loss", policy)
    try:
        if method.setup is not None:
            method.setup(session)
        if session.resume_from is not None:
            state.load_trainer_state(session, session.resume_from)
        if plan.config.checkpoint.resume is not None:  # also with no checkpoint yet: every step is redone
            trim_metrics(session)
    except BaseException:  # from here the method may hold engines or processes: run() closes it after
        close_method(session)
        raise
    return session


def close_method(session: Any) -> None:
    """``Method.close(session)`` once, on every way out of a run that reached the method's setup.

    What it raises is a warning, not the run's outcome: that is decided (saved, or failing for its
    own reason, which must not be masked) by the time the method releases its engines and actors.
    """
    method = session.plan.method.descriptor
    if method.close is None:
        return
    try:
        method.close(session)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        print(f"posttune: warning: method '{method.name}' failed to close: {type(exc).__name__}: "
              f"{first_line(str(exc))}", file=sys.stderr)


def init_distributed(session: Session) -> None:
    """Pick the device; under torchrun, join the process group and build the DeviceMesh."""
    wanted = device_for(session.config.train.device, "config: train.device")  # `auto` resolved
    cuda = torch.device(wanted).type == "cuda"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        session.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(session.device)
        if not dist.is_initialized():
            timeout = session.config.parallel.timeout_s
            # NCCL serves CUDA tensors only; gloo takes the CPU ones (a plan may keep its shards in CPU memory)
            dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout) if timeout is not None else None)
        from posttune.training.sharded_state import check_shared

        check_shared(Path(session.config.checkpoint.output_dir).expanduser())
        dims = session.plan.mesh
        session.mesh = init_device_mesh(session.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    else:
        session.device = torch.device(wanted)
        if cuda and session.device.index is not None:  # cuda:1: what allocates on "cuda" (an engine) goes there too
            torch.cuda.set_device(session.device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_tokenizer(session: Session) -> Any:
    from posttune.config.data_checks import NO_TOKENIZER
    from posttune.tokenizer import load_tokenizer as load

    path = session.config.tokenizer.path or session.config.model.path
    if path is None:  # checked by `posttune validate` too; a run composed from Python gets here
        raise ConfigError("tokenizer.path", NO_TOKENIZER)
    local = not is_hub_id(str(path))
    if session.config.tokenizer.path is None and local and not Path(str(path)).expanduser().is_dir():
        raise ConfigError("model.path", no_directory(path))  # the tokenizer is read from it first: name the model's
    tokenizer = load(path)
    if session.config.tokenizer.chat_template is not None:
        from posttune.tokenizer_files import chat_template_override

        tokenizer.chat_template, where = chat_template_override(session.config.tokenizer.chat_template)
        tokenizer.template_files[tokenizer.chat_template] = where
        warn_split_markers(tokenizer)
    tokenizer.template_kwargs = dict(session.config.tokenizer.chat_template_kwargs)
    return tokenizer


def warn_split_markers(tokenizer: Any) -> None:
    """A template brought to a tokenizer (ChatML on a base model's) may write turn markers the vocabulary lacks:
    each is then learnt as several text tokens, and generation does not stop at it. Not an error (it trains),
    but not what the template's author meant."""
    import re

    for marker in sorted(set(re.findall(r"<\|[^|<>\s]+\|>", tokenizer.chat_template))):
        pieces = len(tokenizer.encode(marker, add_special_tokens=False))
        if pieces > 1 and distributed.is_main():
            print(f"posttune: warning: tokenizer.chat_template writes {marker}, which this tokenizer "
                  f"splits into {pieces} tokens (it is not one of its tokens): the model learns it as text and "
                  f"generation does not stop at it; use a template of the tokenizer's own turn tokens", file=sys.stderr)


# ---- models ------------------------------------------------------------------------------------

def build_policy(session: Session) -> None:
    """The model that trains: build -> adapt -> quantize -> parallelize -> load."""
    target = ModelTarget("policy", session.plan.family.descriptor, session.config.model, trainable=True,
                         score=session.plan.method.descriptor.score_head)
    session.model = build_trained(session, target)
    session.trainable = session.model


def build_trained(session: Session, target: ModelTarget) -> nn.Module:
    """A model the optimizer steps (the policy, or a trained role): every stage, adapters included."""
    session.targets[target.role] = target
    target.model = build_model(target)
    if target.role == "policy":  # on the meta device still: refused before any weight loads
        from posttune.tokenizer import check_fits

        check_fits(session.tokenizer, target.model, "tokenizer.path" if session.config.tokenizer.path else "model")
        warn_past_context(session, target.model)
        warn_growing_rope(session, target.model)
    run_stage(session, "build", target)
    if session.config.adapter is not None:
        inject_adapters(session.config.adapter, target)
    for stage in ("adapt", "quantize", "parallelize"):
        run_stage(session, stage, target)
    load_weights(session, target)
    run_stage(session, "load", target)
    return target.model


def warn_growing_rope(session: Session, model: nn.Module) -> None:
    """Dynamic NTK and LongRoPE choose their frequencies by a forward's longest position, so past their switch
    length the documents that share a forward (a padded batch, as in transformers, or a packed or padding-free
    row) all take the longest one's: a document's loss then depends on its batch-mates. A warning: that is how
    these variants are defined, not a fault of the run."""
    from posttune.modules.rope import GROWING

    rope, length = getattr(model, "rope", None), session.config.data.max_seq_len
    if getattr(rope, "rope_type", None) not in GROWING or not distributed.is_main():
        return
    after = rope.switch_length or rope.max_position_embeddings
    if length > after:
        print(f"posttune: warning: data.max_seq_len: {length} is past the {after} positions where the model's "
              f"{rope.rope_type} RoPE scaling changes its frequencies: documents sharing a forward (a batch, a packed "
              f"or padding-free row) all take those of the longest one (as transformers' padded batches do); "
              f"train.batch_size 1 without packing keeps each document's own", file=sys.stderr)


def warn_past_context(session: Session, model: nn.Module, whose: str = "the model's") -> None:
    """``data.max_seq_len`` past a model's context: longer samples would train positions it never saw (or, for a
    frozen role, be scored there), which RoPE allows (a deliberate context extension sets the checkpoint's rope
    scaling), so a warning. Methods that read prompts bound their own lengths (``max_new_tokens``), and are not
    warned."""
    from posttune.generation import context_length

    context, length = context_length(model), session.config.data.max_seq_len
    kinds = session.plan.method.descriptor.dataset_kinds
    if context is not None and length > context and "prompt" not in kinds and distributed.is_main():
        default = " (the default when not set)" if length == DataConfig.max_seq_len else ""
        print(f"posttune: warning: data.max_seq_len: {length}{default} is past {whose} context of {context} tokens "
              "(max_position_embeddings): longer samples use positions it was never trained on; lower it, or "
              "extend the context on purpose (rope scaling in the checkpoint's config)", file=sys.stderr)


def build_roles(session: Session) -> None:
    """Each model role the method declared: ``session.models[name]``.

    A frozen role with its own source goes through the policy's model stages minus adapters (and
    only the plans and techniques that apply to frozen models, none if its ``run_plans`` is false);
    a role that may be the policy without its adapters costs no memory at all. A trained role is
    built exactly as the policy is (adapters too, in a LoRA/DoRA run) and joins it in
    ``session.trainable``, what the optimizer, gradient clipping and checkpoints see.
    """
    from posttune.adapters import AdaptersOff

    trained: dict[str, nn.Module] = {}
    for name, role in session.plan.roles.items():
        if role.shares_policy:
            session.models[name] = AdaptersOff(session.model)
            if session.config.adapter.init_from is not None and distributed.is_main():
                print(f"posttune: warning: adapter.init_from: the {name} model is the policy with its adapters off, "
                      "model.path's weights without the adapter (as TRL's reference of a PEFT model); to stay "
                      "near the adapter's model, merge it (posttune merge) and train a fresh adapter on that, or set "
                      f"models.{name}.path", file=sys.stderr)
            continue
        target = ModelTarget(name, role.family.descriptor, role.config, trainable=role.role.trained,
                             score=role.role.score)
        if role.role.on_policy:
            session.models[name] = trained[name] = build_policy_head(session, target)
            continue
        if target.trainable:
            session.models[name] = trained[name] = build_trained(session, target)
            continue
        session.targets[name] = target
        target.model = build_model(target).requires_grad_(False)  # frozen before any stage sees it
        warn_past_context(session, target.model, f"the {name} model's")
        for stage in ("build", "quantize", "parallelize"):
            run_stage(session, stage, target)
        load_weights(session, target)
        run_stage(session, "load", target)
        target.model.requires_grad_(False)
        session.models[name] = target.model.eval()
    if trained:
        session.trainable = nn.ModuleDict({"policy": session.model, **trained})


def build_policy_head(session: Session, target: ModelTarget) -> nn.Module:
    """A trained score head on the policy (``ModelRole.on_policy``): drawn as a fresh score head is (or
    resumed from the checkpoint's ``models/<role>/``), then given the run's parallel plans (no technique:
    it has no layers of its own)."""
    from posttune.checkpoint.score_head import HEAD_FILE, PolicyHead, load_policy_head

    target.model = PolicyHead(session.model, device=session.device)
    session.targets[target.role] = target
    saved = session.resume_from / state.model_dir(target.role) if session.resume_from else None
    if saved is not None and (saved / HEAD_FILE).is_file():
        load_policy_head(target.model, saved)
    else:  # a sharded checkpoint restores it later, with the optimizer
        draw_normal(target.model.score.weight, torch.Generator(device="cpu").manual_seed(session.config.train.seed))
    for item in sorted(session.plan.parallel, key=lambda r: r.descriptor.order):
        item.descriptor.apply(session, target)
    return target.model


def build_model(target: ModelTarget) -> nn.Module:
    """The target's family model on the meta device: no memory is spent until the ``load`` stage."""
    config, family = target.config, target.family
    hf_config = generation = None
    if config.path is not None:
        from posttune.checkpoint.hf_load import generation_config
        from posttune.checkpoint.source import local_dir, read_hf_config

        hf_config = read_hf_config(local_dir(config.path))
        generation = generation_config(local_dir(config.path))  # saved back with the trained model
    kwargs = build_kwargs(config, family, hf_config)
    section = "model" if target.role == "policy" else f"models.{target.role}"
    if target.trainable and config.dtype == "fp16":  # a trained role (a value model): the policy's validate refuses
        raise ConfigError(f"{section}.dtype", FP16_TRAINING)
    try:
        model = mat.build(family.build, kwargs, DTYPES[config.dtype], "meta")
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, AssertionError) as exc:
        if not config.build_overrides:  # config.json's values were checked: a failure here is the family's
            raise
        unknown = [key for key in config.build_overrides if f"argument '{key}'" in str(exc)]
        if unknown:  # a builder argument the family does not take (validate names it too)
            raise ConfigError(f"{section}.build_overrides.{unknown[0]}",
                              f"family '{family.name}' builds with no argument '{unknown[0]}'") from None
        if isinstance(exc, ValueError):  # a value the blocks refuse, saying why (an MoE's top_k past its experts)
            raise ConfigError(f"{section}.build_overrides", f"family '{family.name}': {first_line(str(exc))}") from None
        shown = ", ".join(f"{key}={value!r}" for key, value in config.build_overrides.items())  # what failed deeper
        raise ConfigError(f"{section}.build_overrides", f"family '{family.name}' cannot build with {shown}: "
                                                        f"{type(exc).__name__}: {first_line(str(exc))}") from None
    attach(model, ModelOrigin(family.name, kwargs, hf_config, generation, source=config.path))
    stored = str((hf_config or {}).get("dtype") or (hf_config or {}).get("torch_dtype"))
    if config.dtype == "fp32" and stored in ("bfloat16", "float16") and distributed.is_main():
        does = "trains and is saved" if target.trainable else "is held (frozen)"
        print(f"posttune: warning: {section}.dtype is fp32 and {config.path} is stored in {stored}: the model {does} "
              f"in fp32, twice its size; set {section}.dtype: {stored} to keep {stored}", file=sys.stderr)
    labels = checkpoint_labels(hf_config) if hf_config is not None else None
    if labels is not None or target.score:
        add_score_head(model, labels or 1)
    return model


def inject_adapters(adapter: Any, target: ModelTarget) -> None:
    """``adapter:``'s kind on ``target.model`` (the family's default targets unless listed); a score
    head replacing the LM head learns whole beside them. Also what ``posttune plan`` counts. Targets
    may use the checkpoint's Hugging Face module names too (``lm_head``, ``self_attn.q_proj``)."""
    from posttune.adapters import apply_adapters, wrapper
    from posttune.checkpoint.module_names import checkpoint_module_names

    targets = adapter.targets or list(target.family.lora_targets)
    if not targets:
        raise ConfigError("adapter.targets", f"family '{target.family.name}' names no default "
                                             "targets; list module-name patterns")
    wrap = wrapper(adapter, DTYPES[adapter.dtype] if adapter.dtype else None)
    apply_adapters(target.model, targets=targets, wrap=wrap, aliases=checkpoint_module_names(target.model))
    if target.score:  # a new head learns whole beside the adapters (PEFT's modules_to_save)
        target.model.output.requires_grad_(True)


def check_adapter_targets(plan: Any) -> None:
    """Listed ``adapter.targets`` each match a linear layer of the policy: checked before launch on the model
    built on the meta device (no weights), as the run will build it. Called when targets are listed (the
    family's default targets need no check); a model from the hub is checked when the run builds it (its
    config is not fetched to validate)."""
    config = plan.config
    if config.model.path is not None and not Path(str(config.model.path)).expanduser().is_dir():
        return
    target = ModelTarget("policy", plan.family.descriptor, config.model, score=plan.method.descriptor.score_head)
    target.model = build_model(target)
    try:
        inject_adapters(config.adapter, target)
    except ConfigError:
        raise
    except PosttuneError as exc:
        raise ConfigError("adapter.targets", str(exc).removeprefix("adapters: ")) from None
    from posttune.adapters.inject import unmergeable

    tied = unmergeable(target.model)
    if tied and config.checkpoint.save_merged:  # else the merge fails after training, at the final save
        raise ConfigError("checkpoint.save_merged", f"adapter.targets adapts '{tied[0]}', whose weight the embedding "
                                                    "shares (tied embeddings): merging would change the embedding "
                                                    "too; leave it out of adapter.targets, or save the adapter alone")


def run_stage(session: Session, stage: str, target: ModelTarget) -> None:
    """Apply the plans and memory techniques of ``stage`` to ``target``, by their ``order``."""
    items: list[Registered] = [m for m in session.plan.memory if m.descriptor.stage == stage]
    if stage == "parallelize":
        items += session.plan.parallel
    for item in sorted(items, key=lambda r: r.descriptor.order):
        if applies_to(session, item, target):
            item.descriptor.apply(session, target)


def applies_to(session: Session, item: Registered, target: ModelTarget) -> bool:
    """Whether a plan or technique acts on ``target``: on the policy, always; on a frozen role, when
    it acts on frozen models and the role takes the run's plans (``ModelRole.run_plans``)."""
    role = session.plan.roles.get(target.role)
    return target.trainable or (applies_to_frozen(item.descriptor) and (role is None or role.role.run_plans))


def load_weights(session: Session, target: ModelTarget) -> None:
    """Materialise the target and fill it: checkpoint weights, or a seeded random initialisation.

    The policy and trained roles resume their own weights (full fine-tuning) or adapters from the
    checkpoint; a frozen role always loads its source (a seeded random init draws what the policy drew).
    """
    model, config = target.model, session.config
    mat.materialize(model, init_device(session, target))
    saved = session.resume_from / state.model_dir(target.role) if target.trainable and session.resume_from else None
    # A sharded checkpoint restores its weights later, with the optimizer (state.load_trainer_state).
    resumes_hf = saved is not None and saved.is_dir()
    adapted = target.trainable and config.adapter is not None
    source = str(saved) if resumes_hf and not adapted else target.config.path
    if source is None:
        random_init(model, config.train.seed)
    else:
        from posttune.checkpoint.hf_load import load_into

        fresh = load_into(model, source, family=target.family.name)
        if fresh:  # a new score head on a causal checkpoint: drawn as random_init would
            generator = torch.Generator(device="cpu").manual_seed(config.train.seed)
            for _, weight in sorted(fresh.items()):
                draw_normal(weight, generator)
    from posttune.modules import init_buffers

    init_buffers(model)
    if adapted:
        from posttune.adapters import adapter_kind, init_adapters

        init_adapters(model)
        if resumes_hf:
            adapter_kind(config.adapter.kind).load(model, saved)
        elif config.adapter.init_from is not None:
            init_from_adapter(model, config.adapter)
    model.train()


def init_device(session: Session, target: ModelTarget) -> Any:
    """Where ``target``'s parameters materialise: the first plan applied to it whose ``init_device``
    names a device (one that keeps sharded parameters in CPU memory: ``"cpu"``), else the run's device."""
    for item in session.plan.parallel:
        plan = item.descriptor
        if plan.init_device is not None and applies_to(session, item, target):
            device = plan.init_device(session.plan.parallel_options.get(plan.name))
            if device is not None:
                return device
    return session.device


def init_from_adapter(model: nn.Module, adapter: Any) -> None:
    """``adapter.init_from``: start from a finished run's adapter instead of a fresh one.

    The adapters were injected from ``adapter:`` already, so the saved ones must be the same shape: the
    kind's ``validate`` compared its settings with the folder's as the plan resolved (the usual mistake, named
    in one line); the targets and every tensor are checked as they are copied in.
    """
    from posttune.adapters import adapter_kind

    try:
        adapter_kind(adapter.kind).load(model, Path(adapter.init_from).expanduser())
    except PosttuneError as exc:
        raise ConfigError("adapter.init_from", str(exc)) from None


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """Linear and Embedding weights ~ N(0, 0.02), biases 0, norms their own reset, any other parameter
    (a router's, stacked experts) ~ N(0, 0.02); seeded.

    Every rank draws the same full tensors and a sharded (DTensor) weight keeps its own shard,
    so a sharded model starts exactly where the single-process one does. Adapters are skipped
    (``init_adapters`` sets them): the base weights are the same draws with or without LoRA, so
    a frozen role built from the same seed is exactly the policy's base.
    """
    from posttune.adapters import AdaptedLinear

    adapters = {id(part) for layer in model.modules() if isinstance(layer, AdaptedLinear)
                for part in layer.adapter_modules()}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for module in model.modules():
        if id(module) in adapters:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            draw_normal(module.weight, generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif callable(getattr(module, "reset_parameters", None)) and not list(module.children()):
            module.reset_parameters()  # norms: ones or zeros, nothing random
        elif not isinstance(module, AdaptedLinear):  # parameters held directly (a router, stacked experts)
            for param in module.parameters(recurse=False):
                draw_normal(param, generator)


@torch.no_grad()
def draw_normal(weight: torch.Tensor, generator: torch.Generator) -> None:
    """``weight`` ~ N(0, INIT_STD), the whole tensor drawn on every rank (a shard keeps its part)."""
    mat.copy_into(weight, torch.randn(weight.shape, generator=generator, dtype=torch.float32) * INIT_STD)


# ---- data and steps ----------------------------------------------------------------------------

def build_data(session: Session) -> None:
    """The method builds its own loaders, for ``train`` and (when configured, or held out of the training rows
    by ``data.validation_split``) ``validation``."""
    from posttune.config.schema import held_out

    method = session.plan.method
    train, validation = held_out(session.config.data, session.config.train.seed)
    for split, dataset in (("train", train), ("validation", validation)):
        if dataset is None:
            continue
        loader = method.descriptor.data(session, dataset, split)
        if not hasattr(loader, "__iter__"):  # the plugin's error: named here, not as a later TypeError
            raise PluginError(f"method '{method.descriptor.name}' ({method.provenance}): data returned "
                              f"{type(loader).__name__} for {split}, not an iterable of batches (a loader)")
        setattr(session, f"{split}_data", loader)


def total_steps(session: Session) -> int:
    train = session.config.train
    if train.max_steps is not None:
        return train.max_steps
    return train.epochs * steps_per_epoch(session, "train.max_steps", "required")


def steps_per_epoch(session: Session, field: str, problem: str) -> int:
    """Optimizer steps of an epoch (a partial accumulation at its end makes one); what needs it and cannot have it
    (streamed data, a method making its batches as it goes) is refused naming ``field``."""
    try:
        return math.ceil(len(session.train_data) / session.config.train.grad_accum_steps)
    except TypeError:
        if session.config.data.train.streaming:
            raise ConfigError(field, f"{problem} with streaming data (the epoch length is unknown)") from None
        raise ConfigError(field, f"{problem}: method '{session.plan.method.descriptor.name}' makes its batches as it "
                                 "goes, so the epoch length is unknown") from None


def set_cadence(session: Session) -> None:
    """``train.eval_every`` and ``checkpoint.save_every`` in optimizer steps (``epoch``: an epoch's), and with
    ``checkpoint.best_metric`` every checkpoint scored, as numbers of steps are checked before launch."""
    config = session.config
    session.eval_every, session.save_every = (
        steps_per_epoch(session, field, "epoch (give a number of steps) is not possible") if every == "epoch"
        else every for field, every in (("train.eval_every", config.train.eval_every),
                                        ("checkpoint.save_every", config.checkpoint.save_every)))
    if config.checkpoint.best_metric is not None and session.save_every and session.save_every % session.eval_every:
        raise ConfigError("checkpoint.save_every", f"with checkpoint.best_metric its {session.save_every} steps must "
                                                   f"be a multiple of train.eval_every's {session.eval_every}, so "
                                                   "that every checkpoint is scored")


def trim_metrics(session: Session) -> None:
    """Drop metric lines past the resumed step (and a torn last line): a killed run may have logged
    steps it never saved. Written whole to a temporary file, then renamed over the old one."""
    path = Path(session.config.checkpoint.output_dir) / "metrics.jsonl"
    if distributed.is_main() and path.is_file():
        import json

        kept = [r for r in read_metrics(path.parent) if r.get("step", 0) <= session.step]
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid() & 0xFFFFFFFF:08x}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
