"""qlora_nf4: the frozen base weights of the decoder layers stored as 4-bit NormalFloat (QLoRA).

Applied at the ``load`` stage: NF4 quantisation needs real weights, and the meta-device model
has none until the ``load`` stage streamed them in (the adapters are initialised by then as
well). Every frozen ``nn.Linear`` weight inside ``model.layers`` (the bases under LoRA, and
any linear layer left without an adapter) becomes a torchao ``NF4Tensor``: 4-bit codes with
one scale per 64 values, the scales themselves quantised to 8 bits (double quantisation).
A mixture of experts' frozen stacked experts (``posttune.modules.Experts``) are stored the same
way, each stack as one NF4 tensor of ``[experts * out, in]`` (torchao's NF4 is 2-D), unpacked to
``[experts, out, in]`` in the compute dtype once per forward (``Experts.unpack``).
The embedding and the output head stay in the training dtype, as in the QLoRA paper.
torchao's NF4 linear dequantises per matmul; gradients flow to the activations and the
bf16/fp32 adapters, never to the NF4 weights.

At the end of training, with ``checkpoint.save_merged`` (``session.before_final_save``), the policy's base
weights are dequantised back to the training dtype, so the adapter merges into exactly the weights it was
trained against and the merged export is an ordinary HF checkpoint; without it the adapter is saved from the
NF4 model as it is (a dense copy of the whole base would be the run's peak, beyond a one-GPU model's memory).
Resuming reloads the base from ``model.path`` and quantises it again: NF4 is deterministic, so the same codes
result.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from posttune.plugin import ModelTarget, PosttuneError, Session

BLOCK = 64  # values per NF4 scale
SCALER_BLOCK = 256  # scales per double-quantisation block (smaller when a tensor is small)


def apply(session: Session, target: ModelTarget) -> None:
    """The target's frozen decoder linears to NF4; a frozen role (teacher, reference) is quantised whole."""
    model = target.model
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        raise PosttuneError("memory: qlora_nf4 does not support sharded (DTensor) models yet; run it on one device")
    quantized = quantize_frozen_linears(model) + quantize_frozen_experts(model)
    if not quantized:
        raise PosttuneError(f"memory: qlora_nf4 found no frozen linear layer in the {target.role}'s model.layers "
                            "to quantise")
    if target.trainable and session.config.checkpoint.save_merged:  # the adapter alone is saved from the NF4 model
        session.before_final_save.append(lambda s: dequantize(s.model))


def frozen_linears(model: nn.Module) -> dict[str, nn.Linear]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise PosttuneError("memory: qlora_nf4 needs a model with decoder layers in `model.layers`")
    return {f"layers.{name}": module for name, module in layers.named_modules()
            if isinstance(module, nn.Linear) and not module.weight.requires_grad}


def quantize_frozen_linears(model: nn.Module) -> list[str]:
    from torchao.quantization import to_nf4

    done = []
    for name, linear in frozen_linears(model).items():
        weight = linear.weight
        if weight.numel() % BLOCK:
            raise PosttuneError(f"memory: qlora_nf4 cannot quantise '{name}': {weight.numel()} values is not a "
                                f"multiple of the NF4 block size {BLOCK}")
        linear.weight = nn.Parameter(to_nf4(weight.detach(), BLOCK, scaler_block(weight.numel())),
                                     requires_grad=False)
        done.append(name)
    return done


def quantize_frozen_experts(model: nn.Module) -> list[str]:
    """Every frozen stacked-expert weight (3-D) in ``model.layers`` to NF4, flattened to 2-D."""
    from torchao.quantization import to_nf4

    from posttune.modules import Experts

    done = []
    for name, experts in model.get_submodule("layers").named_modules():
        if not isinstance(experts, Experts):
            continue
        for part in ("gate_proj", "up_proj", "down_proj"):
            weight = getattr(experts, part)
            if weight.requires_grad or weight.dim() != 3:
                continue
            flat = weight.detach().reshape(-1, weight.shape[-1])
            setattr(experts, part, nn.Parameter(to_nf4(flat, BLOCK, scaler_block(flat.numel())), requires_grad=False))
            done.append(f"layers.{name}.{part}")
        experts.unpack = partial(unpack_nf4, experts.num_experts)
    return done


def unpack_nf4(num_experts: int, weight: torch.Tensor) -> torch.Tensor:
    """An NF4 ``[experts * out, in]`` stack as ``[experts, out, in]`` in its original dtype; others as they are."""
    if not hasattr(weight, "get_original_weight"):
        return weight
    return weight.get_original_weight().view(num_experts, -1, weight.shape[-1])


def scaler_block(numel: int) -> int:
    """The double-quantisation block: 256 scales, or the largest power of two dividing their count."""
    scales, block = numel // BLOCK, SCALER_BLOCK
    while scales % block:
        block //= 2
    return block


@torch.no_grad()
def dequantize(model: nn.Module) -> list[str]:
    """NF4 weights back to dense ones in their original dtype (what the adapters trained against)."""
    from torchao.quantization.quantize_.workflows import NF4Tensor

    from posttune.modules import Experts

    done = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, NF4Tensor):
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
            done.append(name)
        if isinstance(module, Experts) and module.unpack is not None:
            for part in ("gate_proj", "up_proj", "down_proj"):
                if isinstance(getattr(module, part), NF4Tensor):
                    setattr(module, part, nn.Parameter(module.unpack(getattr(module, part)), requires_grad=False))
                    done.append(f"{name}.{part}")
            module.unpack = None
    return done
