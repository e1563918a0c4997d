"""Qwen3-30B-A3B-shaped MoE layers on one GPU: posttune (grouped GEMM) vs transformers (not a test).

    python benchmarks/moe_gpu.py                              # 2 layers, batch 4 x 2048, bf16, JSON to stdout
    python benchmarks/moe_gpu.py --layers 4 --contenders posttune hf --out result.json

Random weights, nothing downloaded: ``posttune.build_model("qwen3_moe", "30b-a3b", num_layers=N)``
and a transformers ``Qwen3MoeConfig`` of the same shape (written by the family's own
``to_hf_config``: hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8 normalised,
expert intermediate 768, vocabulary 151936, untied head), each built directly on the GPU in bf16
with its own random init (same shapes and distributions, not the same values). Attention: SDPA
on both (transformers' ``attn_implementation="sdpa"``).

The step: forward over random token ids, fp32 cross-entropy over every position against random
labels (the same call on both sides), backward, ``zero_grad(set_to_none=True)``; no optimizer, no
auxiliary loss (posttune's routing records are cleared). Contenders: ``posttune`` (its
``torch._grouped_mm`` path; the JSON says whether it applied), ``hf`` (transformers' default
``experts_implementation``, ``grouped_mm``), ``hf-eager`` (its Python loop over the experts hit).

Each contender is measured alone on the device (the previous one freed), ``--rounds`` times in
alternation: build, ``--warmup`` steps, ``--steps`` timed steps (``torch.cuda.synchronize`` around
them): tokens/s, and ``torch.cuda.max_memory_allocated`` over the warm-up and timed steps (weights,
activations, gradients, logits) next to the memory right after the build. Reported per contender:
the median tokens/s over rounds and the peak; ratios are of medians. Without CUDA it refuses in
one line (exit status 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

CONTENDERS = ("posttune", "hf", "hf-eager")
MIB = 2**20


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers, every one MoE (default 2)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after each build")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each builds every contender)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--out", help="also write the JSON report here")
    return parser.parse_args()


def build(kind: str, layers: int, device: str) -> Any:
    import posttune
    import torch
    from posttune.plugins import get_registry

    torch.manual_seed(0)
    if kind == "posttune":
        return posttune.build_model("qwen3_moe", "30b-a3b", num_layers=layers, dtype=torch.bfloat16,
                                    device=device).train()
    import transformers

    family = get_registry().get("model_family", "qwen3_moe")
    config = transformers.Qwen3MoeConfig.from_dict(family.to_hf_config({**family.sizes["30b-a3b"],
                                                                        "num_layers": layers}))
    implementation = {"experts_implementation": "eager"} if kind == "hf-eager" else {}  # else the default
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa", **implementation)
    return model.to(device).train()


def step(kind: str, model: Any, input_ids: Any, labels: Any) -> None:
    import torch.nn.functional as F

    logits = model(input_ids) if kind == "posttune" else model(input_ids=input_ids).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)).backward()
    if kind == "posttune":
        from posttune.modules.moe import MoE

        for module in model.modules():
            if isinstance(module, MoE):
                module.routing = None
    model.zero_grad(set_to_none=True)


def measure(kind: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """One contender alone on the device: build, warm up, time; its memory."""
    import torch

    model = build(kind, args.layers, device)
    extra: dict[str, Any] = {}
    if kind == "posttune":
        from posttune.modules.moe import Experts, grouped_mm_applies

        probe = torch.empty(1, model.embed.weight.shape[1], dtype=torch.bfloat16, device=device)
        experts = next(m for m in model.modules() if isinstance(m, Experts))
        extra["grouped_mm_applies"] = grouped_mm_applies(probe, experts.gate_proj)
        extra["grouped"] = all(m.grouped for m in model.modules() if isinstance(m, Experts))
    else:
        extra["experts_implementation"] = model.config._experts_implementation
    generator = torch.Generator(device=device).manual_seed(1)
    vocab = model.config.vocab_size if kind != "posttune" else model.embed.weight.shape[0]
    input_ids, labels = (torch.randint(0, vocab, (args.batch, args.seq), generator=generator, device=device)
                         for _ in range(2))
    torch.cuda.synchronize()
    built = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step(kind, model, input_ids, labels)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(kind, model, input_ids, labels)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens_per_s": round(args.batch * args.seq * args.steps / seconds, 1),
            "built_memory_mib": round(built / MIB, 1), "max_memory_allocated_mib": round(peak / MIB, 1), **extra}


def main() -> int:
    args = parse()
    import torch

    if not torch.cuda.is_available():
        print("moe_gpu: no CUDA device: this benchmark measures MoE layers on a GPU; nothing run", file=sys.stderr)
        return 2
    device = "cuda"
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in args.contenders}
    for index in range(args.rounds):
        order = args.contenders[index % len(args.contenders):] + args.contenders[:index % len(args.contenders)]
        for kind in order:
            runs[kind].append(measure(kind, args, device))
            print(f"round {index} {kind}: {json.dumps(runs[kind][-1])}", file=sys.stderr)
    summary = {kind: {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results),
                      "max_memory_allocated_mib": max(r["max_memory_allocated_mib"] for r in results),
                      "built_memory_mib": results[0]["built_memory_mib"]}
               for kind, results in runs.items()}
    ratios = {f"posttune/{other}": round(summary["posttune"]["tokens_per_s_median"]
                                         / summary[other]["tokens_per_s_median"], 3)
              for other in summary if other != "posttune" and "posttune" in summary}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": __import__("transformers").__version__,
              "shape": {"family": "qwen3_moe", "size": "30b-a3b", "num_layers": args.layers, "dtype": "bf16"},
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "tokens_per_step": args.batch * args.seq, "summary": summary, "ratios": ratios, "runs": runs}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
