"""``fully_shard`` each decoder layer, then the root (torchtitan's order).

Runs at the ``parallelize`` stage on the meta-device model, after TP / CP: parameters that
TP already made DTensors on the ``tp`` mesh become 2-D (``dp_shard`` x ``tp``). The trainer
then materialises the sharded model and streams weights into each rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from posttune.plugin import TOKEN_DIMS, flattened

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fsdp_mesh(mesh: Any) -> Any:
    """``dp_shard``, flattened with ``cp`` when present (those ranks also hold different tokens)."""
    dims = tuple(d for d in TOKEN_DIMS if d in (mesh.mesh_dim_names or ()))
    return mesh[dims[0]] if len(dims) == 1 else flattened(mesh, dims)


def mixed_precision(options: Any, model_dtype: str) -> MixedPrecisionPolicy:
    enabled = options.mixed_precision if options.mixed_precision is not None else model_dtype == "bf16"
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[options.param_dtype], reduce_dtype=DTYPES[options.reduce_dtype])


def shard_model(session: Any, target: Any) -> None:
    options = session.plan.parallel_options["fsdp2"]
    model = target.model
    offload: OffloadPolicy = OffloadPolicy()
    if options.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        session.init_device = "cpu"  # sharded parameters live in CPU memory
    kwargs = dict(mesh=fsdp_mesh(session.mesh), mp_policy=mixed_precision(options, target.config.dtype),
                  offload_policy=offload)
    for layer in getattr(model, "layers", ()):  # the native model contract: Decoder.layers
        fully_shard(layer, reshard_after_forward=options.reshard_after_forward, **kwargs)
    # The root (embedding, final norm, head) is needed again right at the start of backward.
    fully_shard(model, reshard_after_forward=False, **kwargs)
