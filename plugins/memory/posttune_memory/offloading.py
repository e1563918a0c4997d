"""activation_offloading: the activations backward needs wait in pinned host memory, not on the GPU.

With activation checkpointing, what a decoder layer keeps for backward is its input (torch's
non-reentrant checkpoint saves it through ``save_for_backward``, outside its own recompute
hooks). Each checkpointed layer's forward runs under ``saved_tensors_hooks`` that copy every
saved CUDA tensor to pinned host memory on a side stream (overlapping the next layer's
compute) and copy it back when backward asks for it. Only decoder layers are wrapped, so the
final norm and the output head, whose saved tensors backward needs first, stay on the GPU.

CUDA only: on a CPU there is no device memory to save and no copy stream, so the technique is
refused (``validate`` before launch, ``apply`` again at compose time) rather than ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posttune.plugin import PosttuneError
from posttune_memory.checkpointing import decoder_layers

MIN_BYTES = 1 << 20  # smaller tensors are not worth a copy each way


def apply(session: Any, target: Any) -> None:
    device = session.device
    if device is None or device.type != "cuda":
        raise PosttuneError(f"memory: 'activation_offloading' needs a CUDA device; this run is on {device}")
    offloader = Offloader(device)  # kept alive by the wrapped forwards that close over it
    for layer in decoder_layers(target.model, "activation_offloading"):
        layer.forward = offloader.wrap(layer.forward)


class Offloader:
    """Pack/unpack hooks sharing one side stream for the host copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward(*args, **kwargs)

        return run

    def pack(self, tensor: torch.Tensor) -> Any:
        if (tensor.device.type != "cuda" or isinstance(tensor, nn.Parameter)
                or tensor.numel() * tensor.element_size() < MIN_BYTES):
            return tensor  # weights and small tensors stay where they are
        compute = torch.cuda.current_stream(tensor.device)
        self.stream.wait_stream(compute)  # the tensor's values are written
        with torch.cuda.stream(self.stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # the allocator keeps it until the copy has read it
        return host, tensor.device, self.stream.record_event()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, device, copied = packed
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(copied)
            tensor = host.to(device, non_blocking=True)
        compute.wait_stream(self.stream)
        tensor.record_stream(compute)
        return tensor
