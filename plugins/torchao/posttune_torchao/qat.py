"""qat: quantisation-aware training, then an export whose weights sit on the int4 grid.

Applied at the ``quantize`` stage, on the meta device: every ``nn.Linear`` inside
``model.layers`` (adapter matrices excepted) becomes torchao's ``FakeQuantizedLinear``, which
rounds its weight to int4 (symmetric, one scale per ``group_size`` input features) and, in the
``8da4w`` scheme, its input to int8 per token (asymmetric) in every forward, with
straight-through gradients. The layer is an ``nn.Linear`` subclass with the same parameter
names, so weights load, save (periodic checkpoints hold the latent full-precision weights, for
exact resume) and shard as before.

Conversion at the end (``session.before_final_save``): each fake-quantised layer is
replaced by a plain ``nn.Linear`` holding its weight *after* fake quantisation, i.e. values
already on the int4 grid, in the training dtype. transformers loads the export as an ordinary
model, and quantising it afterwards with the matching torchao config
(``Int8DynamicActivationInt4WeightConfig(group_size)`` for 8da4w,
``Int4WeightOnlyConfig(group_size)`` for 4w) reproduces exactly the weights training saw.
Why not torchao's own ``convert`` step: its int4 tensor subclasses are not an HF checkpoint
and their kernels need a GPU. Why a session callback rather than a new hook spec: only the
technique that swapped the layers knows how to swap them back, and only for this run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posttune.plugin import AdaptedLinear, ModelTarget, PosttuneError, Session


def fake_quant_configs(scheme: str, group_size: int) -> tuple[Any, Any]:
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    weights = IntxFakeQuantizeConfig(torch.int4, group_size=group_size, is_symmetric=True)
    activations = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False) if scheme == "8da4w" else None
    return activations, weights


def apply(session: Session, target: ModelTarget) -> None:
    options = session.plan.memory_options["qat"]
    swapped = prepare(target.model, options.scheme, options.group_size)
    if not swapped:
        raise PosttuneError("memory: qat found no linear layer in model.layers to fake-quantise")
    session.before_final_save.append(lambda s: convert(s.model))


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise PosttuneError("memory: qat needs a model with decoder layers in `model.layers`")
    adapter_parts = {id(m) for layer in layers.modules() if isinstance(layer, AdaptedLinear)
                     for m in layer.adapter_modules()}
    return {f"layers.{name}": module for name, module in layers.named_modules()
            if isinstance(module, nn.Linear) and id(module) not in adapter_parts}


def prepare(model: nn.Module, scheme: str, group_size: int) -> list[str]:
    from torchao.quantization.qat import FakeQuantizedLinear

    activations, weights = fake_quant_configs(scheme, group_size)
    swapped = []
    for name, linear in target_linears(model).items():
        if linear.in_features % group_size:
            raise PosttuneError(f"memory_options.qat.group_size: {group_size} does not divide '{name}' "
                                f"in_features {linear.in_features}")
        _replace(model, name, FakeQuantizedLinear.from_linear(linear, activations, weights))
        swapped.append(name)
    return swapped


@torch.no_grad()
def convert(model: nn.Module) -> list[str]:
    """Fake-quantised layers -> plain ``nn.Linear`` with the grid-snapped weights (see the docstring)."""
    from torchao.quantization.qat import FakeQuantizedLinear

    converted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, FakeQuantizedLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=module.weight.device, dtype=module.weight.dtype)
            quantizer = module.weight_fake_quantizer
            plain.weight.copy_(quantizer(module.weight) if quantizer is not None else module.weight)
            if module.bias is not None:
                plain.bias.copy_(module.bias)
            plain.weight.requires_grad_(module.weight.requires_grad)
            _replace(model, name, plain)
            converted.append(name)
    return converted


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
