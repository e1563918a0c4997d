"""Peak memory and time of one CPU training step with each memory technique off and on.

    python benchmarks/memory.py                      # every case, JSON to stdout
    python benchmarks/memory.py --cases chunked_cross_entropy --steps 3 --out result.json

Each (case, on/off) runs in a fresh subprocess, which builds its model and batch, records its
peak resident memory (``ru_maxrss``) after setup, runs one warm-up step and ``--steps`` timed
steps, and records the peak again. ``step_peak`` = peak after the steps - peak after setup:
the memory a training step adds on top of weights and batch. This process never imports torch
(a forked child inherits its parent's peak RSS).

Cases (fp32, tiny Llama-shaped models built from posttune-llama, SGD unless noted):
- chunked_cross_entropy: vocab 128256 x seq 2048, hidden 256, 2 layers; the plain loss
  materialises [2048, 128256] logits.
- activation_checkpointing: 8 layers, hidden 384, batch 2 x seq 1024, small vocab; also every=2.
- optimizer_in_backward: 4 wide layers (hidden 768), AdamW, short sequence: gradients dominate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from child import MIB, emit, memory_and_time, run_child

CHILD = r'''
import json, resource, sys, time
from types import SimpleNamespace
import torch
torch.set_num_threads(2)
from posttune_llama.model import build
from posttune.training.compose import random_init
from posttune.losses import token_cross_entropy

spec = json.loads(sys.argv[1])
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = build(**spec["model"], max_position_embeddings=4096, tie_word_embeddings=False)
random_init(model, 0)
model.train()
gen = torch.Generator().manual_seed(0)
batch = {"input_ids": torch.randint(0, spec["model"]["vocab_size"], (spec["batch"], spec["seq"]), generator=gen)}
batch["labels"] = torch.randint(0, spec["model"]["vocab_size"], (spec["batch"], spec["seq"]), generator=gen)
session = SimpleNamespace(model=model, trainable=model, device=torch.device("cpu"),
                          plan=SimpleNamespace(memory_options={}),
                          loss_kernel=None, before_backward=[], clip_gradients=None, mesh=None)
target = SimpleNamespace(model=model, role="policy", trainable=True)
technique = spec.get("technique")
if spec["optimizer"] == "adamw":
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
session.optimizer = optimizer
session.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
if technique == "activation_checkpointing":
    from posttune_memory import CheckpointingConfig
    from posttune_memory.checkpointing import apply
    session.plan.memory_options[technique] = CheckpointingConfig(every=spec.get("every", 1))
    apply(session, target)
elif technique == "chunked_cross_entropy":
    from posttune_memory import ChunkedCrossEntropyConfig
    from posttune_memory.linear_cross_entropy import apply
    session.plan.memory_options[technique] = ChunkedCrossEntropyConfig(**spec.get("options", {}))
    apply(session, target)
elif technique == "optimizer_in_backward":
    from posttune_memory.optimizer_in_backward import apply
    apply(session, target)

def step():
    loss, tokens = token_cross_entropy(session, batch)
    for hook in session.before_backward:  # optimizer_in_backward: the gradient scale, before backward
        hook(session, SimpleNamespace(normaliser=tokens))
    loss.backward()
    for p in model.parameters():  # the trainer's normalisation (nothing left here in backward mode)
        if p.grad is not None:
            p.grad.mul_(1.0 / float(tokens))
    session.optimizer.step()
    session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)

if spec.get("measure") == "activations":
    # What the forward pass keeps alive for backward: resident memory right after the forward,
    # minus right before it (the parent sets MALLOC_MMAP_THRESHOLD_ so that every large tensor
    # is its own mapping and freed ones leave the resident set at once).
    step()  # warm up: lazy allocations, optimizer state
    current = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    before = current()
    loss, tokens = token_cross_entropy(session, batch)
    retained = current() - before
    print(json.dumps({"activations": retained}))
    sys.exit(0)
setup_peak = rss()
step()
times = []
for _ in range(spec["steps"]):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(json.dumps({"setup_peak": setup_peak, "peak": rss(), "step_seconds": times}))
'''

LLAMA_128K = {"vocab_size": 128256, "hidden_size": 256, "intermediate_size": 512, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2}
DEEP = {"vocab_size": 1024, "hidden_size": 384, "intermediate_size": 1024, "num_layers": 8, "num_heads": 6,
        "num_kv_heads": 2}
WIDE = {"vocab_size": 8192, "hidden_size": 768, "intermediate_size": 2048, "num_layers": 4, "num_heads": 8,
        "num_kv_heads": 8}

CASES = {
    "chunked_cross_entropy": [
        ("off", {"model": LLAMA_128K, "batch": 1, "seq": 2048, "optimizer": "sgd"}),
        ("on", {"model": LLAMA_128K, "batch": 1, "seq": 2048, "optimizer": "sgd",
                "technique": "chunked_cross_entropy"}),
    ],
    "activation_checkpointing": [
        ("off", {"model": DEEP, "batch": 2, "seq": 1024, "optimizer": "sgd"}),
        ("on", {"model": DEEP, "batch": 2, "seq": 1024, "optimizer": "sgd", "technique": "activation_checkpointing"}),
        ("every=2", {"model": DEEP, "batch": 2, "seq": 1024, "optimizer": "sgd",
                     "technique": "activation_checkpointing", "every": 2}),
    ],
    "optimizer_in_backward": [
        ("off", {"model": WIDE, "batch": 1, "seq": 128, "optimizer": "adamw"}),
        ("on", {"model": WIDE, "batch": 1, "seq": 128, "optimizer": "adamw", "technique": "optimizer_in_backward"}),
    ],
}


def measure(spec: dict, steps: int) -> dict:
    result = run_child(CHILD, {**spec, "steps": steps})
    held = run_child(CHILD, {**spec, "steps": 0, "measure": "activations"},
                     env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    return {"activations_mib": round(held["activations"] / MIB, 1), **memory_and_time(result)}


def compare(off: dict, on: dict) -> dict:
    return {
        "activations_ratio": round(on["activations_mib"] / max(off["activations_mib"], 1e-9), 3),
        "peak_saved_mib": round(off["peak_mib"] - on["peak_mib"], 1),
        "step_peak_ratio": round(on["step_peak_mib"] / max(off["step_peak_mib"], 1e-9), 3),
        "time_ratio": round(on["step_seconds_median"] / off["step_seconds_median"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    report = {}
    for case in args.cases:
        runs = {label: {"spec": spec, **measure(spec, args.steps)} for label, spec in CASES[case]}
        off = runs["off"]
        report[case] = {"runs": runs, "vs_off": {label: compare(off, run) for label, run in runs.items()
                                                 if label != "off"}}
        print(f"{case}: {json.dumps(report[case]['vs_off'])}", file=sys.stderr)
    emit(report, args.out)


if __name__ == "__main__":
    main()
