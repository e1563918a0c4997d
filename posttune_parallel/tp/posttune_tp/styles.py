"""A family's TP plan (module-name pattern -> style name) as PyTorch parallel styles.

Styles, as in torchtitan's Llama plan (Megatron-LM's layout with sequence parallelism):

``colwise``            ``ColwiseParallel``: the output features split (q/k/v, gate/up; attention
                       then runs on its local heads). The top-level head takes its input
                       sequence-sharded and returns replicated logits.
``rowwise``            ``RowwiseParallel``: the input features split (o/down: one reduction per
                       block); on an ``nn.Embedding``, the vocabulary rows split.
``sequence_parallel``  ``SequenceParallel``: a norm runs on its share of the sequence.
``colwise_vocab_sharded``  the head's logits stay split over the vocabulary as a DTensor
                       (``Shard(-1)``), for vocabulary-parallel cross-entropy (posttune-loss-parallel
                       sets it on the head through ``parallel.options.tp.styles``).
``replicated``         a block TP does not split (a mixture of experts) runs whole on every TP
                       rank: its input gathered, its parameters replicated DTensors used as local
                       tensors, its output split again. Every rank computes the same output and
                       the same gradients, so nothing is reduced.
``per_head``           a module acting on each attention head alone (Qwen3's and Gemma 3's q/k
                       norms) runs on the rank's own heads with its replicated weight; the
                       weight's gradient is summed over the TP ranks, since each saw other heads.

With any ``sequence_parallel`` entry the residual stream between blocks is split over the
sequence: rowwise layers reduce-scatter into ``Shard(1)``, and a block whose projections are
colwise (attention, MLP) all-gathers its first input once on entry (a pre-hook on the block,
so the block's other arguments — RoPE tables, mask, cache — pass untouched). Every sequence
is then right-padded to a multiple of the TP degree (labels ignored), the one change a batch
sees.

LoRA and DoRA (posttune-lora's adapted layer: an ``AdaptedLinear`` holding ``base``, ``lora_A``, ``lora_B``):
colwise base -> ``lora_A`` replicated, ``lora_B`` colwise (its rows follow the base's output
split); rowwise base -> ``lora_A`` rowwise (its input columns follow the base's input split,
the rank-r result all-reduced), ``lora_B`` replicated. Replicated adapter weights are
DTensors too, so their gradients are reduced over the TP ranks like any other. An adapter kind
with another layout is refused by name (a kind of one's own: its layer's TP layout goes here).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from posttune.plugin import AdaptedLinear, ModelTarget, PosttuneError, Session, padded_sequence, tie_groups

STYLES = ("colwise", "rowwise", "sequence_parallel", "colwise_vocab_sharded", "replicated", "per_head")
SEQ = Shard(1)  # the sequence dimension of [batch, seq, hidden] activations


def apply_tp(session: Session, target: ModelTarget) -> None:
    mesh = session.mesh["tp"]
    model = target.model
    options = session.plan.parallel_options["tp"]
    plan = dict(target.family.tp_plan)
    if not options.sequence_parallel:  # the norms run whole on every rank; their weights stay DTensors like the rest
        plan = {pattern: "replicated" if style == "sequence_parallel" else style for pattern, style in plan.items()}
    styles = resolve(model, plan, options.styles, target.family.name)
    if not styles:  # every rank would train the whole model and call it tensor parallel
        raise PosttuneError(f"tp: family '{target.family.name}' declares no tp_plan (ModelFamily.tp_plan: module-name "
                            f"pattern -> style), so nothing would split over the tp ranks; remove tp, or give the "
                            f"family a plan (docs/plugins.md)")
    sequence_parallel = "sequence_parallel" in styles.values()
    ties = tie_groups(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    gathered: set[str] = set()
    for name, style in styles.items():
        module = model.get_submodule(name)
        parent, _, _ = name.rpartition(".")
        if isinstance(module, AdaptedLinear):
            if not parent:
                raise PosttuneError(f"tp: an adapter on the top-level module '{name}' is not supported; "
                                    f"leave it out of adapter.targets")
            parallelize_lora(module, style, mesh, sequence_parallel)
        else:
            parallelize_module(module, mesh, torch_style(style, module, sequence_parallel, top_level=not parent))
        if sequence_parallel and style == "colwise" and parent and parent not in gathered:
            gather_sequence_on_entry(model.get_submodule(parent), mesh)
            gathered.add(parent)
    retie(model, ties)
    for name, param in model.named_parameters():  # some styles re-wrap weights as trainable Parameters
        if name in frozen:
            param.requires_grad_(False)
    if sequence_parallel and target.trainable:  # one padding per micro-batch serves every model of the run
        degree = mesh.size()
        session.step_contexts.append(lambda _session, batch: padded_sequence(batch, degree))


def resolve(model: nn.Module, plan: Mapping[str, str], overrides: Mapping[str, str], family: str) -> dict[str, str]:
    """Module name -> style for every module a pattern matches; an unknown style or a pattern
    that matches nothing is an error naming it (it would silently leave weights unsplit)."""
    names = [name for name, _ in model.named_modules() if name]
    styles: dict[str, str] = {}
    for pattern, style in {**plan, **overrides}.items():
        if style not in STYLES:
            raise PosttuneError(f"tp: family '{family}' plan gives '{pattern}' the unknown style '{style}' "
                                f"(known: {', '.join(STYLES)})")
        found = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            raise PosttuneError(f"tp: family '{family}' plan pattern '{pattern}' matches no module of the model")
        styles.update(dict.fromkeys(found, style))
    order = {name: i for i, name in enumerate(names)}
    return dict(sorted(styles.items(), key=lambda item: order[item[0]]))


def torch_style(style: str, module: nn.Module, sequence_parallel: bool, *, top_level: bool) -> ParallelStyle:
    between_blocks = SEQ if sequence_parallel else Replicate()  # layout of the residual stream
    if style == "replicated":
        return RunWhole(between_blocks)
    if style == "per_head":
        return RunWhole(None)
    if style == "sequence_parallel":  # local output: a post-norm's joins the residual stream, a plain tensor
        return SequenceParallel(use_local_output=True)
    if style == "rowwise":
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
        return RowwiseParallel(output_layouts=between_blocks)
    if style == "colwise_vocab_sharded":
        return ColwiseParallel(input_layouts=between_blocks, output_layouts=Shard(-1), use_local_output=False)
    if top_level:  # the head: its input comes straight from the residual stream
        return ColwiseParallel(input_layouts=between_blocks, output_layouts=Replicate())
    return ColwiseParallel()  # inside a block whose entry gathered the sequence


def parallelize_lora(layer: AdaptedLinear, style: str, mesh: Any, sequence_parallel: bool) -> None:
    if not isinstance(getattr(layer, "lora_A", None), nn.Linear) or not isinstance(getattr(layer, "lora_B", None),
                                                                                   nn.Linear):
        raise PosttuneError(f"tp: adapter kind '{layer.kind}' has no tensor-parallel layout (LoRA and DoRA have); "
                            "drop tp or use one of those kinds")
    between_blocks = SEQ if sequence_parallel else Replicate()
    if style == "colwise":
        parallelize_module(layer.base, mesh, ColwiseParallel())
        parallelize_module(layer.lora_A, mesh, Replicated(output_layout=Replicate(), use_local_output=False))
        parallelize_module(layer.lora_B, mesh, ColwiseParallel())
    elif style == "rowwise":
        parallelize_module(layer.base, mesh, RowwiseParallel(output_layouts=between_blocks))
        parallelize_module(layer.lora_A, mesh, RowwiseParallel(output_layouts=Replicate(), use_local_output=False))
        parallelize_module(layer.lora_B, mesh, Replicated(output_layout=between_blocks, use_local_output=True))
    else:
        raise PosttuneError(f"tp: adapters on a '{style}' layer are not supported")


class Replicated(ParallelStyle):
    """Parameters replicated over the TP mesh (as DTensors, so their gradients are reduced),
    the first input made a replicated DTensor, the output redistributed to ``output_layout``."""

    def __init__(self, *, output_layout: Any, use_local_output: bool):
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def input_fn(_module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
            first = inputs[0]
            if not isinstance(first, DTensor):
                first = DTensor.from_local(first, mesh, [Replicate()], run_check=False)
            return (first.redistribute(mesh, [Replicate()]), *inputs[1:])

        def output_fn(_module: nn.Module, output: DTensor, mesh: Any) -> Any:
            output = output.redistribute(mesh, [self.output_layout])
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


class RunWhole(ParallelStyle):
    """The ``replicated`` and ``per_head`` styles (see the module docstring): the module's own forward,
    unchanged, on local tensors. ``torch.func.functional_call`` hands it the local parts of its
    replicated parameters, so their gradients flow back to the DTensors. ``between_blocks``: the
    residual stream's layout, gathered on entry and restored on exit (``replicated``); None for a
    module on the rank's own heads (``per_head``), whose gradients are then summed over the ranks."""

    def __init__(self, between_blocks: Any):
        super().__init__()
        self.between_blocks = between_blocks

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                if isinstance(param, DTensor):  # another plan's split (experts over ep): used as its local part
                    continue
                replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
                setattr(owner, name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        layout, running, group = self.between_blocks, {"inside": False}, device_mesh.get_group()
        own_forward = type(module).forward

        def local(param: torch.Tensor) -> torch.Tensor:
            if not isinstance(param, DTensor):
                return param
            if layout is not None or device_mesh.mesh_dim_names != param.device_mesh.mesh_dim_names:
                return param.to_local()
            return _SumGrad.apply(param.to_local(), group)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if running["inside"]:  # functional_call's own call of the module
                return own_forward(module, *args, **kwargs)
            first = args[0]
            if layout is not None:
                if not isinstance(first, DTensor):
                    first = DTensor.from_local(first, device_mesh, [layout], run_check=False)
                first = first.redistribute(device_mesh, [Replicate()]).to_local()
            params = {name: local(p) for name, p in module.named_parameters()}
            running["inside"] = True
            try:
                out = torch.func.functional_call(module, params, (first, *args[1:]), kwargs)
            finally:
                running["inside"] = False
            if layout is None:
                return out
            out = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            return out.redistribute(device_mesh, [layout]).to_local()

        module.forward = forward
        return module


class _SumGrad(torch.autograd.Function):
    """Identity; the gradient summed over ``group`` (a weight each rank applied to its own heads)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_sequence_on_entry(block: nn.Module, mesh: Any) -> None:
    """All-gather a sequence-split first input once, where a block of colwise projections starts."""

    def gather(_module: nn.Module, args: tuple) -> tuple:
        first = args[0]
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, [SEQ], run_check=False)
        return (first.redistribute(mesh, [Replicate()]), *args[1:])

    block.register_forward_pre_hook(gather)


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """``parallelize_module`` wraps each module's weight in a new Parameter: share tied ones again.

    Tied weights split the same way (the embedding's vocabulary rows and the head's output rows
    are both dim 0), so the first module's DTensor serves both.
    """
    for first, *rest in groups:
        shared = model.get_parameter(first)
        for name in rest:
            owner, _, attr = name.rpartition(".")
            other = model.get_parameter(name)
            if getattr(other, "placements", None) != getattr(shared, "placements", None):
                raise PosttuneError(f"tp: tied weights '{first}' and '{name}' are split differently "
                                    f"({getattr(shared, 'placements', None)} vs {getattr(other, 'placements', None)})")
            setattr(model.get_submodule(owner), attr, shared)
