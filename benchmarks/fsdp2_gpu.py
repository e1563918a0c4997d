"""FSDP2 SFT throughput and peak memory of a ~1B-shaped Llama on one GPU (not a test).

    python benchmarks/fsdp2_gpu.py [--steps 20] [--batch-size 4] [--seq-len 2048] [--vocab-size 32000]

Builds posttune's Llama at the shape of Llama-3.2-1B (16 layers, hidden 2048, GQA 32:8) on
the meta device, shards it with the ``fsdp2`` plugin's own ``shard_model`` (NCCL process group
of world size 1, mesh ``dp_shard=1``; bf16 model, so FSDP2 mixed precision with fp32 gradient
reduction), materialises it on the GPU with posttune's seeded random init, and trains on random
token batches with AdamW: forward, next-token cross-entropy (posttune.losses), backward, clip,
step. Prints one JSON object: tokens/s over the timed steps (after warm-up) and peak CUDA memory.

The vocabulary defaults to 32000 (Llama-2 size) so the 1B shape is the transformer itself;
pass --vocab-size 128256 for Llama-3.2-1B exactly. On a machine without CUDA it refuses in one
line (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args()


def main() -> int:
    args = parse()
    import torch

    if not torch.cuda.is_available():
        print("fsdp2_gpu: no CUDA device: this benchmark measures FSDP2 on a GPU (NCCL); nothing run",
              file=sys.stderr)
        return 2
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from posttune.checkpoint import materialize as mat
    from posttune.modules import init_buffers
    from posttune.training.compose import random_init
    from posttune.training.distributed import clip_grad_norm
    import posttune_fsdp2
    from posttune_fsdp2 import FSDP2Options
    from posttune_fsdp2.shard import shard_model
    from posttune_llama.model import build
    from posttune_llama.sizes import LLAMA_SIZES

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
        kwargs = {**LLAMA_SIZES["1b"], "vocab_size": args.vocab_size}
        model = mat.build(build, kwargs, torch.bfloat16, "meta")
        options = FSDP2Options(reshard_after_forward=args.reshard_after_forward)
        session = SimpleNamespace(model=model, mesh=mesh, plan=SimpleNamespace(
            parallel_options={"fsdp2": options}, mesh_dims={"dp_shard": posttune_fsdp2.MESH_DIM}))
        shard_model(session, SimpleNamespace(model=model, config=SimpleNamespace(dtype="bf16")))
        mat.materialize(model, device)
        random_init(model, seed=0)
        init_buffers(model)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        generator = torch.Generator(device=device).manual_seed(0)

        def step() -> float:
            ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device,
                                generator=generator)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()  # synchronises, so the wall clock covers the step

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        losses = [step() for _ in range(args.steps)]
        seconds = time.perf_counter() - start
        tokens = args.steps * args.batch_size * args.seq_len
        print(json.dumps({
            "benchmark": "fsdp2_gpu",
            "device": torch.cuda.get_device_name(device),
            "parameters": params,
            "dtype": "bf16 (FSDP2 mixed precision: bf16 params, fp32 reduce)",
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "tokens_per_s": round(tokens / seconds, 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "last_loss": round(losses[-1], 4),
        }))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
