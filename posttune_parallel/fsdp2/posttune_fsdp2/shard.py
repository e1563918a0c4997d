"""``fully_shard`` each decoder layer, then the root (torchtitan's order).

Runs at the ``parallelize`` stage on the meta-device model, after TP / CP: parameters that
TP already made DTensors on the ``tp`` mesh become 2-D (``dp_shard`` x ``tp``). A module whose
parameters another plan already split over a dimension that holds different tokens (experts
over ``ep``) is sharded on its own first, over the remaining token dimensions only: its
parameters become 2-D too (``dp_shard`` x ``ep``) and the layer's unit leaves them alone. The
trainer then materialises the sharded model and streams weights into each rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from posttune.plugin import ModelTarget, Session, token_mesh

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mixed_precision(options: Any, model_dtype: str) -> MixedPrecisionPolicy:
    enabled = options.mixed_precision if options.mixed_precision is not None else model_dtype == "bf16"
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[options.param_dtype], reduce_dtype=DTYPES[options.reduce_dtype])


def shard_model(session: Session, target: ModelTarget) -> None:
    options = session.plan.parallel_options["fsdp2"]
    model = target.model
    offload: OffloadPolicy = OffloadPolicy()
    if options.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # the plan's init_device is "cpu"
    # ``dp_shard``, flattened with the other dimensions whose ranks hold different tokens (cp's)
    kwargs = dict(mesh=token_mesh(session), mp_policy=mixed_precision(options, target.config.dtype),
                  offload_policy=offload)
    for module, dims in split_over_token_dims(session, model):
        fully_shard(module, **{**kwargs, "mesh": sub_mesh(session.mesh, dims)},
                    reshard_after_forward=options.reshard_after_forward)
    for layer in getattr(model, "layers", ()):  # the native model contract: Decoder.layers
        fully_shard(layer, reshard_after_forward=options.reshard_after_forward, **kwargs)
    # The root (embedding, final norm, head) is needed again right at the start of backward, so a trained model
    # keeps it gathered; a frozen role has no backward to free it, and would hold it whole on every rank for the
    # rest of the run (a method that reads its head after the forward keeps it: posttune-kd's teacher).
    trained = any(p.requires_grad for p in model.parameters())
    fully_shard(model, reshard_after_forward=not trained, **kwargs)


def token_dims(session: Session) -> tuple[str, ...]:
    """The mesh dimensions whose ranks hold different tokens, in mesh order."""
    names = session.mesh.mesh_dim_names if session.mesh is not None else ()
    return tuple(d for d in names or () if session.plan.mesh_dims[d].splits != "none")


def split_over_token_dims(session: Session, model: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """(module, the token dimensions left to shard it over) for each module holding parameters that a
    plan already split over a token dimension."""
    from torch.distributed.tensor import DTensor

    dims, found = token_dims(session), []
    for module in model.modules():
        taken = {name for p in module.parameters(recurse=False) if isinstance(p, DTensor)
                 for name in p.device_mesh.mesh_dim_names or ()} & set(dims)
        if taken:
            found.append((module, tuple(d for d in dims if d not in taken)))
    return found


def sub_mesh(mesh: Any, dims: tuple[str, ...]) -> Any:
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("_".join(dims))
