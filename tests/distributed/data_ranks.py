"""Run under torchrun with 2 gloo ranks: a mesh dp_shard=1 x cp=2 built from the plans' own declarations. Both cp
ranks hold the same rows (one data rank) and sum their losses over both (a token group of 2). Prints RESULT json."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import posttune_cp
import posttune_fsdp2
from posttune.training import distributed

dist.init_process_group("gloo")
dims = {"dp_shard": posttune_fsdp2.MESH_DIM, "cp": posttune_cp.MESH_DIM}
session = SimpleNamespace(mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=tuple(dims)),
                          plan=SimpleNamespace(mesh_dims=dims))
found = {"rank": dist.get_rank(), "data_rank": list(distributed.data_rank(session)),
         "token_group_size": distributed.token_group(session)[1]}
gathered = [None, None]
dist.all_gather_object(gathered, found)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(gathered), flush=True)
distributed.shutdown()
distributed.exit_process(0)  # as a worker leaves: the mesh's live gloo threads could abort the teardown
