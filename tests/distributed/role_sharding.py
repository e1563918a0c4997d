"""Run under torchrun with a config and a role name (default ``reference``): compose the session and
report how that frozen model role is held.

Rank 0 prints ``RESULT {json}``: whether every parameter of the role is a DTensor sharded over the
data-parallel ranks, frozen, and how many of its values this rank holds against the whole model; and whether
every parameter is sharded again after a forward pass (no backward will reshard a frozen model).
"""

import json
import os
import sys

import torch

from posttune.config import load_config, validate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.training import distributed
from posttune.training.compose import compose

config = validate(load_config(sys.argv[1], []))
session = compose(resolve_plan(config, get_registry(), world_size=int(os.environ["WORLD_SIZE"])))
reference = session.models[sys.argv[2] if len(sys.argv) > 2 else "reference"]
params = list(reference.parameters())
report = {
    "all_dtensors": all(distributed.is_dtensor(p) for p in params),
    "placements": sorted({str(tuple(p.placements)) for p in params if distributed.is_dtensor(p)}),
    "frozen": not any(p.requires_grad for p in params),
    "local_values": sum(p.to_local().numel() if distributed.is_dtensor(p) else p.numel() for p in params),
    "full_values": sum(p.numel() for p in params),
    "policy_frozen_params": sum(not p.requires_grad for p in session.model.parameters()),
}
with torch.no_grad():  # a frozen role has no backward: its forward must leave every weight sharded again
    reference(torch.zeros(1, 8, dtype=torch.long))
report["sharded_after_forward"] = all(distributed.is_dtensor(p) for p in reference.parameters())
if distributed.is_main():
    print("RESULT " + json.dumps(report), flush=True)
distributed.shutdown()
distributed.exit_process(0)  # as a worker leaves: the mesh's live gloo threads could abort the teardown
