"""Run under torchrun: context-parallel logits (flex attention, load-balanced shards) vs. one process.

Every rank builds the same seeded tiny Llama, computes the single-process logits twice (SDPA,
and flex attention over the whole sequence on one rank), then the CP logits of its share; rank 0
reassembles the shares and prints the max differences for padded rows and for packed rows
(documents). Against one-process flex the only difference left is the sharding itself.
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from posttune.training import distributed
from posttune_cp.shard import ContextParallel, attach, head_tail_order

if sys.argv[2:] == ["gemma2"]:  # soft-capped attention scores (no window: cp refuses one); a small cap that binds
    from posttune_gemma.model import build
    from posttune_gemma.sizes import GEMMA2_SIZES

    SIZE = {**GEMMA2_SIZES["tiny"], "sliding_window": None, "layer_types": None, "attn_softcap": 0.5}
else:
    from posttune_llama.model import build
    from posttune_llama.sizes import LLAMA_SIZES

    SIZE = LLAMA_SIZES["tiny"]

dist.init_process_group("gloo")
cp = dist.get_world_size()
mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
torch.manual_seed(0)
dtype = getattr(torch, sys.argv[1])  # float32: the training dtype; float64: kernel rounding out of the way
model = build(**{**SIZE, "vocab_size": 96}).to(dtype).eval()
ids = torch.randint(0, 96, (2, 22), generator=torch.Generator().manual_seed(1))
documents = torch.tensor([[0] * 9 + [1] * 7 + [2] * 6, [0] * 22])

state = ContextParallel(mesh, multiple=2 * cp)
# the same model and padding on one rank: flex attention over the whole sequence, nothing gathered
torch.manual_seed(0)
flex_model = build(**{**SIZE, "vocab_size": 96}).to(dtype).eval()
one_rank = ContextParallel(SimpleNamespace(size=lambda: 1, get_local_rank=lambda: 0), multiple=2 * cp)
one_rank.gather_kv = lambda k, v: (k, v)
attach(flex_model, one_rank)
results = {}
with torch.no_grad():
    for name, docs in (("padded", None), ("packed", documents)):
        reference = model(ids, document_ids=docs)
        hooks = attach(model, state) if name == "padded" else None
        batch = {"input_ids": ids.clone(), "labels": ids.clone()}
        if docs is not None:
            batch["document_ids"] = docs.clone()
        with state.step(None, batch):
            local = model(batch["input_ids"], document_ids=batch.get("document_ids"))
        shares = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(shares, local.contiguous())
        seq_len = local.shape[1] * cp
        full = torch.empty(local.shape[0], seq_len, local.shape[2], dtype=dtype)
        full[:, head_tail_order(seq_len, cp).flatten()] = torch.cat(shares, dim=1)
        results[name] = (full[:, :ids.shape[1]] - reference).abs().max().item()
        alone = {"input_ids": ids.clone(), "labels": ids.clone()}
        if docs is not None:
            alone["document_ids"] = docs.clone()
        with one_rank.step(None, alone):
            flex_reference = flex_model(alone["input_ids"], document_ids=alone.get("document_ids"))
        results[f"{name}_vs_flex"] = (full[:, :ids.shape[1]] - flex_reference[:, :ids.shape[1]]).abs().max().item()
        results[f"{name}_local_len"] = local.shape[1]
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(results))
distributed.shutdown()
distributed.exit_process(0)  # as a worker leaves: the mesh's live gloo threads could abort the teardown
