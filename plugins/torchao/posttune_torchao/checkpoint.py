"""torchao-quantized checkpoints as transformers writes and reads them (``quant_method: torchao``).

A quantized weight is a torchao tensor subclass (``Int8Tensor``: int8 values plus one scale per
row or group). safetensors stores plain tensors only, so each subclass is flattened into its
parts, ``q_proj._weight_qdata`` and ``q_proj._weight_scale``, and the file's header metadata
records, per weight, the subclass and its non-tensor attributes as JSON; plain tensors are
marked ``{"_type": "Tensor"}``. This is torchao's own safetensors format
(``torchao.prototype.safetensors``), the one transformers 5 saves and loads for
``TorchAoConfig``; it rebuilds only an allow-list of torchao classes, never arbitrary code,
unlike the pickled ``.bin`` files older releases used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from posttune.plugin import PosttuneError

#: safetensors header metadata key listing every tensor of the state dict (torchao's format)
TENSOR_NAMES = "tensor_names"


def flatten(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(plain tensors on the CPU, header metadata) for a state dict holding torchao subclasses.

    Flattened where the tensors are: a layout built for a GPU kernel (int4 tile-packed) need not
    support moving to the CPU as a whole, but its plain parts always do.
    """
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    tensors, metadata = flatten_tensor_state_dict(dict(state))
    return {key: value.contiguous().cpu() for key, value in tensors.items()}, {**metadata, "format": "pt"}


def read(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of a torchao checkpoint, quantized ones rebuilt as their subclass.

    Shards are read in turn; the parts of one weight that a shard boundary split are kept until
    the shard holding the rest arrives, so at most one shard's tensors wait at a time.
    """
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    metadata = _metadata(files)
    waiting: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                waiting[key] = handle.get_tensor(key)
        done, waiting = unflatten_tensor_state_dict(waiting, metadata)
        yield from done.items()
    if waiting:
        shown = ", ".join(sorted(waiting)[:5])
        raise PosttuneError(f"{files[0].parent}: torchao checkpoint: tensor {shown} is not part of any weight "
                            f"the metadata lists (a shard is missing, or the files were written by another tool)")


def _metadata(files: Sequence[Path]) -> dict[str, str]:
    from safetensors import safe_open

    metadata: dict[str, Any] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            metadata.update(handle.metadata() or {})
    if TENSOR_NAMES not in metadata:
        raise PosttuneError(f"{files[0].parent}: config.json says quant_method 'torchao' but the safetensors "
                            f"header has no torchao metadata ('{TENSOR_NAMES}'); re-export it with `posttune "
                            f"quantize` or transformers 5")
    try:
        json.loads(metadata[TENSOR_NAMES])
    except ValueError:
        raise PosttuneError(f"{files[0].parent}: unreadable torchao metadata '{TENSOR_NAMES}'") from None
    return metadata
