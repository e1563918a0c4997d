"""fp8: float8 training of the decoder's linear layers (torchao.float8), CUDA only.

Applied at the ``quantize`` stage (a module swap, before TP and FSDP2 wrap the layers, as
torchtitan orders it). Inputs, weights and output gradients of each matmul are cast to
float8 with dynamic tensorwise scales; the weights themselves stay in the training dtype.
Layers whose dimensions are not multiples of 16 (float8 matmul alignment) and the output
head stay in high precision. Needs compute capability 8.9+ (Ada, Hopper): refused before
launch on a CPU run and again here on an older GPU. Written and guarded; not run in CI.
"""

from __future__ import annotations

import torch
from torch import nn

from posttune.plugin import ModelTarget, PosttuneError, Session


def apply(session: Session, target: ModelTarget) -> None:
    device = session.device
    if device is None or device.type != "cuda":
        raise PosttuneError(f"memory: 'fp8' needs a CUDA device; this run is on {device}")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise PosttuneError(f"memory: 'fp8' needs compute capability 8.9 or newer; "
                            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # pad_inner_dim: the weight gradient's matmul runs over batch x sequence, which _scaled_mm needs to be a
    # multiple of 16; padded or padding-free batches are of any length
    convert_to_float8_training(target.model, config=Float8LinearConfig(pad_inner_dim=True),
                               module_filter_fn=float8_eligible)


def float8_eligible(module: nn.Module, name: str) -> bool:
    return (isinstance(module, nn.Linear) and name.startswith("layers.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)
