"""Mixture-of-experts training step on CPU: posttune's MoE against transformers' Qwen3-MoE, same weights.

    python benchmarks/moe.py                                   # fp32 and bf16, 5 rounds, JSON to stdout
    python benchmarks/moe.py --dtype fp32 --rounds 7 --steps 3 --out result.json
    python benchmarks/moe.py --quick                           # tiny sizes: a smoke check (the e2e test)

The model: a ``Qwen3MoeConfig`` (vocabulary 2048, hidden 512, 4 layers, all of them MoE, 8 experts,
top-2 with normalised top-k weights, expert intermediate 512, 8 query / 4 KV heads of 64, untied
head), random init by transformers (seed 0), saved with ``save_pretrained`` and loaded by both:
transformers' ``Qwen3MoeForCausalLM.from_pretrained`` and ``posttune.load_model`` (which stacks
the per-expert tensors). Both attend with ``F.scaled_dot_product_attention`` (transformers'
``attn_implementation="sdpa"``, posttune's own SDPA path), causal, no padding.

The step: forward over a batch of ``--batch`` x ``--seq`` random token ids, cross-entropy (in fp32,
the same ``F.cross_entropy`` call on both sides) against random labels over every position,
backward, gradients dropped (``zero_grad(set_to_none=True)``); no optimizer, no auxiliary loss
(transformers computes none unless ``output_router_logits``; posttune's routing records, which
its forward always makes when gradients are on, are cleared after each step and not added).
tokens/s = batch x seq / the step's wall time.

Contenders (the experts' implementation is the only switch within a library):
- ``posttune``: ``Experts`` with ``torch._grouped_mm`` (its default);
- ``posttune-loop``: ``grouped = False`` on every ``Experts``: a Python loop over the experts;
- ``hf``: transformers' default ``experts_implementation``, which in transformers 5.x is
  ``"grouped_mm"`` (``torch.nn.functional.grouped_mm`` on CPU too, torch >= 2.11) - what a user gets;
- ``hf-eager``: ``experts_implementation="eager"``: ``Qwen3MoeExperts.forward``, a Python loop over
  the experts hit. transformers' third option, ``"batched_mm"``, gathers one weight matrix per
  token slot (``gate_up_proj[expert_ids]``: 2 GiB per layer here in fp32), so it is left out.

Timing: one child process per dtype holds both models (posttune-loop is the posttune model with
``grouped`` off, hf-eager the transformers model switched with ``set_experts_implementation``),
runs ``--warmup`` untimed steps per contender, then ``--rounds`` rounds; each round runs every
contender for ``--steps`` steps, the order rotating each round, and records its tokens/s for the
round. Per contender: the median over rounds (and the rounds); ``ratios`` are of those medians,
``ratios_within_rounds_median`` the median over rounds of each round's own ratio.
Memory: each contender again in a fresh child process (the model alone; ``ru_maxrss``): peak RSS
after the imports, after loading, and after ``--warmup`` + 1 steps (--quick: posttune and hf only).
This parent never imports torch (a forked child would inherit its peak).

Each round records the 1-minute load average: on a shared 2-core machine another busy process
slows a run, so read the medians and ratios, never a single timing.
--quick: a 2-layer hidden-64 model with 4 experts, batch 2 x 16, fp32, 2 rounds of 1 step, the
peak RSS of posttune and hf only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from child import emit, run_child

HERE = Path(__file__).resolve().parent

CHILD = r'''
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["bench_dir"])
import moe
print(json.dumps(moe.child(spec)))
'''

#: the measured model (transformers' Qwen3MoeConfig arguments); every layer is an MoE layer
SHAPE = {"vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 512}
QUICK_SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 32}
CONTENDERS = ("posttune", "posttune-loop", "hf", "hf-eager")
#: (name, numerator, denominator) of the reported ratios of median tokens/s
RATIOS = (("posttune/hf", "posttune", "hf"), ("posttune/hf-eager", "posttune", "hf-eager"),
          ("posttune/posttune-loop", "posttune", "posttune-loop"), ("hf/hf-eager", "hf", "hf-eager"))
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
#: --quick measures peak RSS of these only (each transformers child spends ~9 s importing the model class)
MEMORY_QUICK = ("posttune", "hf")


# ---------------------------------------------------------------- children (torch imported here only)

def rss_mib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def save_checkpoint(model_dir: Path, shape: dict[str, int]) -> dict[str, int]:
    """The random-init Qwen3-MoE checkpoint (fp32), written once by transformers; its parameter counts."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**shape, norm_topk_prob=True, max_position_embeddings=4096,
                                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    model.save_pretrained(model_dir)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
    experts = shape["num_hidden_layers"] * shape["num_experts"] * per_expert
    active = total - experts + experts * shape["num_experts_per_tok"] // shape["num_experts"]
    return {"parameters": total, "active_parameters_per_token": active}


def load(kind: str, spec: dict[str, Any]) -> Any:
    """The model a contender runs, in train mode, with its experts' implementation set."""
    import torch

    dtype = getattr(torch, DTYPES[spec["dtype"]])
    if kind.startswith("posttune"):
        import posttune

        model = posttune.load_model(spec["model_dir"], dtype=dtype)
        set_posttune_grouped(model, kind == "posttune")
    else:
        import transformers

        chosen = {"experts_implementation": "eager"} if kind == "hf-eager" else {}  # else transformers' default
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype,
                                                                 attn_implementation="sdpa", **chosen)
    return model.train()


def set_posttune_grouped(model: Any, grouped: bool) -> None:
    from posttune.modules.moe import Experts

    experts = [module for module in model.modules() if isinstance(module, Experts)]
    assert experts, "no posttune Experts module in the model"
    for module in experts:
        module.grouped = grouped


def batches(spec: dict[str, Any], count: int) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    shape, vocab = (spec["batch"], spec["seq"]), spec["shape"]["vocab_size"]
    return [(torch.randint(0, vocab, shape, generator=generator), torch.randint(0, vocab, shape, generator=generator))
            for _ in range(count)]


def step(kind: str, model: Any, input_ids: Any, labels: Any) -> float:
    """One forward + backward; the loss."""
    import torch.nn.functional as F

    if kind.startswith("posttune"):
        logits = model(input_ids)
    else:
        logits = model(input_ids=input_ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    if kind.startswith("posttune"):
        clear_routing(model)
    model.zero_grad(set_to_none=True)
    return loss.item()


def clear_routing(model: Any) -> None:
    """Drop the routing statistics posttune's MoE layers record for the auxiliary loss (not used here)."""
    from posttune.modules.moe import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            module.routing = None


def time_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    models = {"posttune": load("posttune", spec), "hf": load("hf", spec)}
    owner = {"posttune": "posttune", "posttune-loop": "posttune", "hf": "hf", "hf-eager": "hf"}

    def prepare(kind: str) -> Any:
        model = models[owner[kind]]
        if kind.startswith("posttune"):
            set_posttune_grouped(model, kind == "posttune")
        else:
            model.set_experts_implementation("eager" if kind == "hf-eager" else "grouped_mm")
        return model

    data = batches(spec, max(spec["steps"], spec["warmup"], 1))
    with torch.no_grad():  # same weights, same function: the logits must agree
        ours = models["posttune"](data[0][0]).float()
        theirs = models["hf"](input_ids=data[0][0]).logits.float()
    logits_diff = (ours - theirs).abs().max().item()
    implementations = {}
    first_loss, warmup_seconds = {}, {}
    for kind in CONTENDERS:
        model = prepare(kind)
        if kind.startswith("hf"):
            implementations[kind] = model.config._experts_implementation
        start = time.perf_counter()
        losses = [step(kind, model, *data[i % len(data)]) for i in range(spec["warmup"])]
        warmup_seconds[kind] = round(time.perf_counter() - start, 3)
        first_loss[kind] = round(losses[0] if losses else step(kind, model, *data[0]), 6)
    rounds: dict[str, list[float]] = {kind: [] for kind in CONTENDERS}
    load_average = []
    tokens = spec["batch"] * spec["seq"] * spec["steps"]
    for index in range(spec["rounds"]):
        order = CONTENDERS[index % len(CONTENDERS):] + CONTENDERS[:index % len(CONTENDERS)]
        load_average.append(round(os.getloadavg()[0], 2))
        for kind in order:
            model = prepare(kind)
            start = time.perf_counter()
            for i in range(spec["steps"]):
                step(kind, model, *data[i % len(data)])
            rounds[kind].append(round(tokens / (time.perf_counter() - start), 1))
    load_average.append(round(os.getloadavg()[0], 2))
    return {"tokens_per_s_rounds": rounds, "logits_max_abs_diff": logits_diff, "first_step_loss": first_loss,
            "warmup_seconds": warmup_seconds, "hf_experts_implementation": implementations,
            "load_average_1min": load_average, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    kind = spec["contender"]
    if kind.startswith("posttune"):
        import posttune  # noqa: F401
    else:
        from transformers import Qwen3MoeForCausalLM  # noqa: F401  (the lazy module import is ~170 MiB)
    imports = rss_mib()
    model = load(kind, spec)
    loaded = rss_mib()
    for input_ids, labels in batches(spec, spec["warmup"] + 1):
        step(kind, model, input_ids, labels)
    return {"import_rss_mib": imports, "loaded_rss_mib": loaded, "peak_rss_mib": rss_mib()}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["task"] == "memory":
        return memory_child(spec)
    model_dir = Path(spec["model_dir"])
    counts = None if model_dir.exists() else save_checkpoint(model_dir, spec["shape"])  # the first dtype's child
    return {"counts": counts, **time_child(spec)}


# ---------------------------------------------------------------- the parent (no torch)

def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), help="default: fp32 bf16 (--quick: fp32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every child (default 1)")
    parser.add_argument("--rounds", type=int, help="timed rounds per contender (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, help="steps per contender per round (default 2; --quick 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps per contender first (default 1)")
    parser.add_argument("--batch", type=int, help="rows per step (default 4; --quick 2)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 256; --quick 16)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-contender peak-RSS children")
    parser.add_argument("--quick", action="store_true", help="a tiny model, few steps: a smoke check")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args()
    quick = args.quick
    args.dtype = args.dtype or (["fp32"] if quick else ["fp32", "bf16"])
    args.rounds = args.rounds or (2 if quick else 5)
    args.steps = args.steps or (1 if quick else 2)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.batch = args.batch or (2 if quick else 4)
    args.seq = args.seq or (16 if quick else 256)
    return args


def child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}


def summarise(timing: dict[str, Any], memory: dict[str, dict[str, float]]) -> dict[str, Any]:
    contenders = {}
    for kind in CONTENDERS:
        rounds = timing["tokens_per_s_rounds"][kind]
        contenders[kind] = {"tokens_per_s_median": statistics.median(rounds), "tokens_per_s_min": min(rounds),
                            "tokens_per_s_max": max(rounds), "tokens_per_s_rounds": rounds, **memory.get(kind, {})}
    ratios = {name: round(contenders[a]["tokens_per_s_median"] / contenders[b]["tokens_per_s_median"], 3)
              for name, a, b in RATIOS}
    rounds = timing["tokens_per_s_rounds"]  # the same ratios taken within each round (the load drifts less)
    paired = {name: round(statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True)), 3)
              for name, a, b in RATIOS}
    if "posttune" in memory and "hf" in memory:
        ratios["peak_rss posttune/hf"] = round(memory["posttune"]["peak_rss_mib"] / memory["hf"]["peak_rss_mib"], 3)
    return {"contenders": contenders, "ratios": ratios, "ratios_within_rounds_median": paired,
            **{key: timing[key] for key in ("logits_max_abs_diff", "first_step_loss", "hf_experts_implementation",
                                            "warmup_seconds", "load_average_1min")}}


def table(dtype: str, result: dict[str, Any]) -> str:
    lines = [f"{dtype}: " + ", ".join(f"{k} {v}" for k, v in result["ratios"].items())]
    for kind, row in result["contenders"].items():
        peak = f", peak RSS {row['peak_rss_mib']:.0f} MiB" if "peak_rss_mib" in row else ""
        lines.append(f"  {kind:14s} {row['tokens_per_s_median']:9.1f} tok/s median "
                     f"({', '.join(f'{x:.0f}' for x in row['tokens_per_s_rounds'])}){peak}")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> int:
    args = parse()
    shape = QUICK_SHAPE if args.quick else SHAPE
    env = child_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="posttune-moe-") as work:
        base = {"bench_dir": str(HERE), "model_dir": str(Path(work) / "model"), "shape": shape,
                "threads": args.threads, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                "warmup": args.warmup, "rounds": args.rounds}
        results, counts = {}, None
        for dtype in args.dtype:
            spec = {**base, "dtype": dtype}
            timing = run_child(CHILD, {**spec, "task": "time"}, env=env)
            if counts is None:
                counts = timing["counts"]
                print(f"workload: Qwen3-MoE {shape}, {counts['parameters']:,} parameters "
                      f"({counts['active_parameters_per_token']:,} active per token), batch {args.batch} x "
                      f"{args.seq}, {args.threads} thread(s)", file=sys.stderr)
            measured = () if args.no_memory else MEMORY_QUICK if args.quick else CONTENDERS
            memory = {kind: run_child(CHILD, {**spec, "task": "memory", "contender": kind}, env=env)
                      for kind in measured}
            results[dtype] = summarise(timing, memory)
            print(table(dtype, results[dtype]), file=sys.stderr)
    report = {
        "workload": {"model": {"architecture": "Qwen3MoeForCausalLM", **shape, "norm_topk_prob": True,
                               "tie_word_embeddings": False, **counts},
                     "batch": args.batch, "seq": args.seq, "tokens_per_step": args.batch * args.seq,
                     "step": "forward + fp32 cross-entropy over every position + backward; no optimizer, no aux loss",
                     "attention": "sdpa (both)"},
        "settings": {"threads": args.threads, "rounds": args.rounds, "steps_per_round": args.steps,
                     "warmup_steps": args.warmup, "quick": args.quick, "dtypes": args.dtype},
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count()},
        "versions": {key: timing[key] for key in ("torch", "transformers")},
        "results": results,
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
