"""Full SFT throughput, MFU and peak memory of 1B- and 3B-shaped Llamas on one GPU (not a test).

    python benchmarks/gpu.py                               # 1b and 3b, JSON per model
    python benchmarks/gpu.py --models 3b --no-compile --checkpointing on --out result.json
    python benchmarks/gpu.py --cpu-smoke                   # the same code path, tiny, on CPU, fp32

Each model trains in a fresh child process through the same path as ``posttune train``
(``resolve_plan`` -> ``compose`` -> ``train``; no final save): posttune's llama family at the
shape of Llama-3.2-1B or -3B (``model.size``, vocabulary ``--vocab-size``, default 128256 as
released), random init built directly on the device, bf16, full fine-tuning, AdamW lr 1e-5,
constant schedule, packed rows of ``--seq-len`` tokens (``method.packing``) of synthetic
pseudo-word documents tokenized by a BPE trained here (``compare_support/workload.py``; nothing
is downloaded), ``memory: [compile, chunked_cross_entropy]`` plus ``activation_checkpointing``
for 3b (``--checkpointing auto``), and ``parallel: [fsdp2]``. Flags toggle each.

FSDP2 at world size 1: posttune runs a config's parallel plans only when there is more than one
process (``plan.py``: "one process: the same config runs with the plans inactive"), so on one
GPU the listed ``fsdp2`` is inactive and the model trains unsharded; the report says which plans
were active (``active_parallel_plans``).

Reported per model: tokens/s over the timed steps (non-padding tokens: packed rows have only a
tail of padding), MFU, peak memory (``torch.cuda.max_memory_allocated``; RSS with --cpu-smoke),
steps. MFU = (6 x matmul parameters + attention) FLOPs per token x tokens/s / (--peak-tflops,
default 989: H100/H200 SXM bf16 dense). Matmul parameters: every projection plus the LM head
(the embedding lookup is not a matmul). Attention: causal, per packed document of n tokens and
per layer 6 * n^2 * heads * head_dim over forward and backward (2 n^2 d forward: QK^T and AV,
halved by causality, x3), i.e. 6 * layers * heads * head_dim * sum(n^2)/sum(n) per token, from
the documents' token lengths. Activation-checkpoint recomputation is not counted (it is not
useful work), so checkpointed runs show a lower MFU for the same hardware efficiency.

--cpu-smoke: posttune-llama's ``tiny`` shape, fp32, on CPU, 3 steps (1 warm-up), compile with
the ``aot_eager`` backend (tracing without code generation); it checks the script, not speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from child import emit, run_child

HERE = Path(__file__).resolve().parent

CHILD = r'''
import json, sys
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["bench_dir"])
from gpu import train_one
print(json.dumps(train_one(spec)))
'''


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["1b", "3b"], choices=["1b", "3b"])
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch-size", type=int, default=4, help="packed rows per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row (data.max_seq_len)")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's bf16 dense peak")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile-backend", help="torch.compile backend (default inductor; --cpu-smoke aot_eager)")
    parser.add_argument("--chunked-ce", action=argparse.BooleanOptionalAction, default=True,
                        help="memory technique chunked_cross_entropy")
    parser.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                        help="activation_checkpointing (auto: on for 3b only)")
    parser.add_argument("--fsdp2", action=argparse.BooleanOptionalAction, default=True,
                        help="list parallel plan fsdp2 (inactive at world size 1)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shape, fp32, CPU: checks the code path")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU smoke; default torch's)")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args()
    if args.cpu_smoke:
        args.models = ["tiny"]
        args.steps, args.warmup_steps, args.batch_size, args.seq_len = 2, 1, 2, 256
        args.compile_backend = args.compile_backend or "aot_eager"
    return args


def run_config(spec: dict, work: Path, techniques: list[str]) -> dict:
    smoke = spec["size"] == "tiny"
    memory = []
    if spec["compile"]:
        memory.append("compile")
    if spec["chunked_ce"]:
        memory.append("chunked_cross_entropy")
    if spec["checkpointing"]:
        memory.append("activation_checkpointing")
    missing = [name for name in memory if name not in techniques]
    if missing == ["compile"] and smoke:  # the smoke check runs without it where it does not exist yet
        memory.remove("compile")
    elif missing:
        raise SystemExit(f"gpu.py: memory technique(s) {', '.join(missing)} not registered by any installed plugin "
                         f"(registered: {', '.join(techniques)}); pass --no-compile / --no-chunked-ce / "
                         "--checkpointing off")
    config = {
        "model": {"family": "llama", "size": spec["size"], "dtype": "fp32" if smoke else "bf16",
                  "build_overrides": {"vocab_size": spec["vocab_size"]}},
        "tokenizer": {"path": str(work / "tokenizer")},
        "method": {"name": "sft", "packing": True, "padding_free": False},  # rows of exactly seq_len: one shape
        "data": {"train": {"path": str(work / "docs.jsonl"), "format": "text"}, "max_seq_len": spec["seq_len"]},
        "train": {"max_steps": spec["warmup_steps"] + spec["steps"], "batch_size": spec["batch_size"],
                  "lr": 1e-5, "weight_decay": 0.0, "scheduler": "constant", "max_grad_norm": 1.0, "seed": 0,
                  "device": spec["device"]},
        "memory": memory,
        "checkpoint": {"output_dir": str(work / "out"), "save_every": None, "overwrite": True},
    }
    if "compile" in memory and spec.get("compile_backend"):
        config["memory_options"] = {"compile": {"backend": spec["compile_backend"]}}
    if spec["fsdp2"]:
        config["parallel"] = {"plans": ["fsdp2"]}
    return config


def write_documents(work: Path, tokens_needed: int, seq_len: int) -> list[int]:
    """Pseudo-word documents as ``text`` rows, enough for ``tokens_needed`` packed tokens; returns
    each document's token count as trained (EOS included, cut at ``seq_len``)."""
    import json
    import random

    from compare_support.workload import Words, build_tokenizer
    from posttune.tokenizer import load_tokenizer

    build_tokenizer(work / "tokenizer", vocab_size=2048)
    tokenizer = load_tokenizer(work / "tokenizer")
    words, rng = Words(seed=0), random.Random(0)
    lengths, rows = [], []
    while sum(lengths) < tokens_needed * 1.05:
        text = words.text(rng.randint(max(8, seq_len // 16), max(16, seq_len // 2)))
        rows.append(json.dumps({"text": text}))
        lengths.append(min(len(tokenizer.encode(text)) + 1, seq_len))
    (work / "docs.jsonl").write_text("\n".join(rows) + "\n")
    return lengths


def matmul_parameters(kwargs: dict) -> int:
    h, layers = kwargs["hidden_size"], kwargs["num_layers"]
    heads, kv = kwargs["num_heads"], kwargs.get("num_kv_heads") or kwargs["num_heads"]
    head_dim = kwargs.get("head_dim") or h // heads
    per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * kwargs["intermediate_size"]
    return layers * per_layer + kwargs["vocab_size"] * h


def train_one(spec: dict) -> dict:
    """One model's run (in the child): compose, train, measure."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from compare_support.timing import peak_rss_mib, posttune_steps
    from posttune.config import validate
    from posttune.plan import model_kwargs, resolve_plan
    from posttune.plugins import get_registry
    from posttune.training import output_dir
    from posttune.training.compose import compose
    from posttune.training.metrics import read_metrics
    from posttune.training.trainer import train

    device = torch.device(spec["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu.py: no CUDA device; run with --cpu-smoke to check the script on CPU")
    work = Path(spec["work"])
    tokens_needed = (spec["warmup_steps"] + spec["steps"]) * spec["batch_size"] * spec["seq_len"]
    documents = write_documents(work, tokens_needed, spec["seq_len"])
    registry = get_registry()
    config = validate(run_config(spec, work, registry.names("memory_technique")))
    plan = resolve_plan(config, registry)
    kwargs = model_kwargs(config, registry)
    with output_dir.claimed(plan.config, main=True):
        session = compose(plan)
        parameters = sum(p.numel() for p in session.model.parameters())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        train(session)
        peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_rss_mib())
    tokens, seconds, losses = posttune_steps(read_metrics(work / "out"))
    warm = spec["warmup_steps"]
    timed_tokens, timed_seconds = sum(tokens[warm:]), sum(seconds[warm:])
    tokens_per_s = timed_tokens / max(timed_seconds, 1e-9)
    matmul = matmul_parameters(kwargs)
    heads = kwargs["num_heads"]
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // heads
    attention_per_token = 6 * kwargs["num_layers"] * heads * head_dim * (sum(n * n for n in documents)
                                                                         / sum(documents))
    flops_per_token = 6 * matmul + attention_per_token
    return {
        "model": spec["size"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": config.model.dtype,
        "parameters": parameters,
        "matmul_parameters": matmul,
        "shape": {k: kwargs[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                         "num_heads", "num_kv_heads")},
        "batch_size": spec["batch_size"],
        "seq_len": spec["seq_len"],
        "memory": list(config.memory),
        "memory_options": dict(config.memory_options),
        "parallel_plans": list(config.parallel.plans),
        "active_parallel_plans": [p.descriptor.name for p in plan.parallel],
        "steps": len(tokens),
        "timed_steps": len(tokens) - warm,
        "warmup_seconds": round(sum(seconds[:warm]), 2),
        "timed_tokens": timed_tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": round(flops_per_token),
        "attention_flops_share": round(attention_per_token / flops_per_token, 4),
        "mfu": round(flops_per_token * tokens_per_s / (spec["peak_tflops"] * 1e12), 6),
        "peak_tflops": spec["peak_tflops"],
        "peak_memory_mib": round(peak, 1),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss",
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
    }


def main() -> int:
    args = parse()
    reports = []
    for size in args.models:
        with tempfile.TemporaryDirectory(prefix=f"posttune-gpu-{size}-") as work:
            checkpointing = args.checkpointing == "on" or (args.checkpointing == "auto" and size == "3b")
            spec = {"bench_dir": str(HERE), "work": work, "size": size, "steps": args.steps,
                    "warmup_steps": args.warmup_steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                    "vocab_size": 2048 if args.cpu_smoke else args.vocab_size, "peak_tflops": args.peak_tflops,
                    "compile": args.compile, "compile_backend": args.compile_backend, "chunked_ce": args.chunked_ce,
                    "checkpointing": checkpointing, "fsdp2": args.fsdp2, "threads": args.threads,
                    "device": "cpu" if args.cpu_smoke else "cuda"}
            result = run_child(CHILD, spec)
        print(f"{size}: {result['tokens_per_s']:.1f} tokens/s, MFU {result['mfu']:.4f}, peak "
              f"{result['peak_memory_mib']:.1f} MiB, {result['steps']} steps", file=sys.stderr)
        reports.append(result)
    emit({"benchmark": "gpu", "cpu_smoke": args.cpu_smoke, "models": reports}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
