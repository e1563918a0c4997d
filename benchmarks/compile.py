"""Training throughput with the ``compile`` technique off and on (tokens/s after warm-up, peak RSS).

    python benchmarks/compile.py                        # Llama-shaped 8 x 512, CPU, 3 runs each
    python benchmarks/compile.py --quick                # tiny model, short: checks the script works
    python benchmarks/compile.py --checkpointing --device cuda --runs 5 --out result.json

Each measurement runs in a fresh child process (its own Dynamo caches and its own peak resident
memory), alternating eager and compiled runs so that a change in machine load hits both. A
child builds the model and applies the same technique code a run uses
(``posttune_memory.compile.apply``, after ``activation_checkpointing`` when asked), then trains
on batches whose lengths cycle through ``--lengths`` (as ``data.pad_to_multiple_of`` buckets
them). The warm-up steps see every length once, so every graph is compiled before timing;
``warmup_seconds`` is how long that took (inductor caches compiled graphs on disk across
processes: ``--cold`` disables the caches to time a cold compile). Timed steps report tokens/s (non-padding
tokens: all of them here). The report: per-run numbers, medians per mode, and the ratio
compiled / eager of the medians (> 1: compiled is faster).

The numbers only mean something on an otherwise idle machine; this script quotes none.
"""

from __future__ import annotations

import argparse
import os
import statistics

from child import MIB, emit, run_child

CHILD = r'''
import json, resource, sys, time
from types import SimpleNamespace
import torch

spec = json.loads(sys.argv[1])
if spec["threads"]:
    torch.set_num_threads(spec["threads"])
from posttune_llama.model import build
from posttune.losses import token_cross_entropy
from posttune.training.compose import random_init

device = torch.device(spec["device"])
model = build(**spec["model"], max_position_embeddings=4096, tie_word_embeddings=False)
random_init(model, 0)
model.to(device).train()
lengths = spec["lengths"]
config = SimpleNamespace(data=SimpleNamespace(max_seq_len=max(lengths), pad_to_multiple_of=min(lengths)),
                         train=SimpleNamespace(batch_size=spec["batch"]))
session = SimpleNamespace(model=model, device=device, loss_kernel=None, config=config,
                          plan=SimpleNamespace(memory_options={}))
target = SimpleNamespace(model=model, role="policy", trainable=True)
if spec["checkpointing"]:
    from posttune_memory import CheckpointingConfig
    from posttune_memory.checkpointing import apply as checkpoint
    session.plan.memory_options["activation_checkpointing"] = CheckpointingConfig()
    checkpoint(session, target)
if spec["compiled"]:
    from posttune_memory import CompileConfig
    from posttune_memory.compile import apply as compile_model
    session.plan.memory_options["compile"] = CompileConfig(**spec["options"])
    compile_model(session, target)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(0)
vocab = spec["model"]["vocab_size"]

def make_batch(length):
    ids = torch.randint(3, vocab, (spec["batch"], length), generator=gen)
    labels = torch.randint(3, vocab, ids.shape, generator=gen)
    labels[:, : int(length * spec["prompt_fraction"])] = -100  # a prompt: nothing learned there
    return {"input_ids": ids.to(device), "labels": labels.to(device)}

def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()

def step(batch):
    loss, tokens = token_cross_entropy(session, batch)
    (loss / tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

start = time.perf_counter()
for length in lengths:  # warm-up: every shape once (compiles every graph)
    step(make_batch(length))
sync()
compile_seconds = time.perf_counter() - start
batches = [make_batch(lengths[i % len(lengths)]) for i in range(spec["steps"])]
tokens = sum(b["input_ids"].numel() for b in batches)  # every position is a token (none is padding)
start = time.perf_counter()
for batch in batches:
    step(batch)
sync()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"tokens_per_s": tokens / seconds, "seconds": seconds, "compile_seconds": compile_seconds,
                  "peak_rss": peak, "threads": torch.get_num_threads()}))
'''

FULL = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_layers": 8,
        "num_heads": 8, "num_kv_heads": 4}
QUICK = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 run each, few steps")
    parser.add_argument("--runs", type=int, default=None, help="runs per mode (default 3; --quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; --quick: 4)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="padded batch lengths, cycled (default 512 1024; --quick: 32 64)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads in each child (default: torch's; on a loaded machine use 1: "
                             "OpenMP threads competing for busy cores make both modes erratic)")
    parser.add_argument("--cold", action="store_true",
                        help="disable inductor's on-disk caches, so warmup_seconds is a cold compile every run")
    parser.add_argument("--checkpointing", action="store_true", help="activation_checkpointing in both modes")
    parser.add_argument("--prompt-fraction", type=float, default=0.0,
                        help="the share of each row whose labels are ignored, as a prompt's are (default 0)")
    parser.add_argument("--backend", default="inductor")
    # false: the batches come in a few padded lengths (data.pad_to_multiple_of), one graph each; the technique's
    # own default (none) is for padding-free rows, whose every length differs
    parser.add_argument("--dynamic", choices=["false", "true", "none"], default="false")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    return parser.parse_args()


def summary(results: list[dict]) -> dict:
    return {
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in results), 1),
        "peak_rss_mib_median": round(statistics.median(r["peak_rss"] for r in results) / MIB, 1),
        # the warm-up steps' time: compilation and all, for the compiled runs; the first steps' own cost for eager
        "warmup_seconds_median": round(statistics.median(r["compile_seconds"] for r in results), 2),
        "threads": sorted({r["threads"] for r in results}),
        "runs": [{"tokens_per_s": round(r["tokens_per_s"], 1), "peak_rss_mib": round(r["peak_rss"] / MIB, 1),
                  "warmup_seconds": round(r["compile_seconds"], 2)} for r in results],
    }


def main() -> None:
    args = parse()
    runs = args.runs or (1 if args.quick else 3)
    spec = {
        "model": QUICK if args.quick else FULL, "batch": args.batch, "device": args.device, "threads": args.threads,
        "steps": args.steps or (4 if args.quick else 20), "lengths": args.lengths or ([32, 64] if args.quick
                                                                                     else [512, 1024]),
        "checkpointing": args.checkpointing, "prompt_fraction": args.prompt_fraction,
        "options": {"backend": args.backend, "dynamic": {"false": False, "true": True, "none": None}[args.dynamic]},
    }
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"} if args.cold else None
    results: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for _ in range(runs):  # alternate, so a load change hits both modes alike
        for mode in ("eager", "compiled"):
            results[mode].append(run_child(CHILD, {**spec, "compiled": mode == "compiled"}, env=env))
    report = {"spec": spec, "runs_per_mode": runs, **{mode: summary(r) for mode, r in results.items()}}
    report["ratio_tokens_per_s"] = round(report["compiled"]["tokens_per_s_median"]
                                         / report["eager"]["tokens_per_s_median"], 3)
    report["ratio_peak_rss"] = round(report["compiled"]["peak_rss_mib_median"]
                                     / report["eager"]["peak_rss_mib_median"], 3)
    emit(report, args.out)


if __name__ == "__main__":
    main()
