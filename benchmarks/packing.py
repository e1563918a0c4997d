"""Throughput of SFT on the same data padded vs packed (and padded with group_by_length). (issue 15)

    python benchmarks/packing.py                      # 3 alternating runs of each mode, JSON to stdout
    python benchmarks/packing.py --quick              # a smaller model, fewer steps: a smoke run
    python benchmarks/packing.py --modes padded packed --runs 5 --out result.json

Each measurement is a real ``posttune train`` (sft, the llama family built at the shape below,
random init, AdamW) in a fresh child process, on an alpaca-like dataset written by the child
from a fixed seed: responses whose sample lengths run from 18 to 305 tokens, skewed short as
alpaca's are. The modes differ only in the data options (SFT's ``method.packing`` and
``method.padding_free``, ``data.group_by_length``; each set where the posttune measured keeps
it, ``data:`` in older ones; off unless the mode sets it); batch size and ``max_seq_len`` are the
same, so a packed step holds ``batch_size`` rows of ``max_seq_len`` tokens and a padded step ``batch_size`` samples. The
child times every optimizer step (from the end of the previous one, so loading and collation
count) and reports tokens/s over the non-padding tokens of the steps after ``--warmup`` (also
per CPU second of the process, steadier on a shared machine), and its peak resident memory.
Runs alternate between modes (padded, packed, ..., padded, packed) so that a machine's drift
hits every mode alike; the report gives each mode's median and the ratio of each mode's
median to padded's. This process never imports torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from child import MIB, emit, run_child

CHILD = r'''
import json, math, os, random, resource, sys, tempfile, time
spec = json.loads(sys.argv[1])
import torch
torch.set_num_threads(spec["threads"])
import yaml
import posttune.training.trainer as trainer
from posttune.cli.main import main

def response(rng):
    """Capital letters, lognormal length (median ~110 tokens), clipped to alpaca-like 18-305 tokens."""
    length = min(max(int(rng.lognormvariate(math.log(110), 0.6)), 12), 290)
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ ") for _ in range(length))

rng = random.Random(spec["seed"])
rows = [{"instruction": f"Write item {i}.", "input": "", "output": response(rng)} for i in range(spec["samples"])]
tmp = tempfile.mkdtemp(prefix="posttune-packing-")
with open(os.path.join(tmp, "train.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
import dataclasses, posttune_llama, posttune_sft, pathlib
from posttune.config.schema import DataConfig
in_data = {field.name for field in dataclasses.fields(DataConfig)}  # older posttunes: packing sat here
in_method = {field.name for field in dataclasses.fields(posttune_sft.SFTConfig)}
settings = dict(spec["settings"])
if "padding_free" in in_data | in_method:  # padded means padded rows: SFT may default to padding-free batches
    settings.setdefault("padding_free", False)
if not set(settings) <= in_data | in_method:  # e.g. padding_free on a posttune without it
    print(json.dumps({"status": "unsupported", "missing": sorted(set(settings) - in_data - in_method)}))
    sys.exit(0)
config = {
    "model": {"family": "llama", "size": "tiny", "build_overrides": spec["model"]},
    "tokenizer": {"path": str(pathlib.Path(posttune_llama.__file__).parent / "demo" / "tokenizer")},
    "method": {"name": "sft", **{key: value for key, value in settings.items() if key not in in_data}},
    "data": {"train": {"path": os.path.join(tmp, "train.jsonl"), "format": "alpaca"},
             "max_seq_len": spec["max_seq_len"], **{key: value for key, value in settings.items() if key in in_data}},
    "train": {"epochs": 100, "max_steps": spec["warmup"] + spec["steps"], "batch_size": spec["batch_size"],
              "lr": 1e-4, "seed": 0, "device": "cpu", "sample_prompts": []},
    "checkpoint": {"output_dir": os.path.join(tmp, "out"), "save_every": None},
}
with open(os.path.join(tmp, "run.yaml"), "w") as f:
    yaml.safe_dump(config, f)

from posttune.modules.decoder import Decoder
forward = Decoder.forward
positions = [0]
def counting(self, input_ids, **kwargs):  # what the model computes, padding included
    positions[0] += input_ids.numel() if torch.is_grad_enabled() else 0
    return forward(self, input_ids, **kwargs)
Decoder.forward = counting
step = trainer._optimizer_step
marks = []
def timed(session, window, log, *rest):
    tokens = step(session, window, log, *rest)
    marks.append((time.perf_counter(), float(tokens), time.process_time(), positions[0]))
    return tokens
trainer._optimizer_step = timed
model_start = time.perf_counter()
status = main(["train", os.path.join(tmp, "run.yaml")])
times = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
cpu = [b[2] - a[2] for a, b in zip(marks, marks[1:])]
tokens = [m[1] for m in marks[1:]]
kept = slice(spec["warmup"] - 1, None)  # the first mark ends step 1: steps after the warm-up
print(json.dumps({"status": status, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "tokens": sum(tokens[kept]), "seconds": sum(times[kept]), "cpu_seconds": sum(cpu[kept]),
                  "positions": marks[-1][3] - marks[spec["warmup"] - 1][3],
                  "step_seconds": times[kept]}))
'''

#: hidden 512, 8 layers of 8 heads, intermediate 1408, vocab 2048 (untied): 27.8M parameters
MODEL = {"vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1408, "num_layers": 8, "num_heads": 8,
         "num_kv_heads": 8, "max_position_embeddings": 1024}
QUICK_MODEL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 352, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 4, "max_position_embeddings": 1024}
MODES = {
    "padded": {"packing": False},
    "packed": {"packing": True},  # rows of exactly max_seq_len (padding_free is off unless a mode sets it)
    "packed_padding_free": {"packing": True, "padding_free": True},  # the packed rows end to end, tails dropped
    "grouped": {"packing": False, "group_by_length": True},
    "padding_free": {"packing": False, "padding_free": True},  # where posttune has padding_free
}


def measure(mode: str, args: argparse.Namespace) -> dict:
    spec = {"model": QUICK_MODEL if args.quick else MODEL, "settings": MODES[mode], "seed": 0,
            "samples": args.samples, "max_seq_len": args.max_seq_len, "batch_size": args.batch_size,
            "warmup": args.warmup, "steps": args.steps, "threads": args.threads}
    result = run_child(CHILD, spec)
    if result["status"] == "unsupported":
        raise SystemExit(f"{mode}: this posttune has no setting {', '.join(result['missing'])}")
    if result["status"] != 0:
        raise SystemExit(f"{mode}: posttune train exited {result['status']}")
    tokens_per_s = result["tokens"] / result["seconds"]
    print(f"{mode}: {tokens_per_s:.1f} tok/s, peak {result['peak'] / MIB:.0f} MiB", file=sys.stderr)
    return {"tokens_per_s": round(tokens_per_s, 1), "peak_mib": round(result["peak"] / MIB, 1),
            "tokens": int(result["tokens"]), "seconds": round(result["seconds"], 3),
            # per CPU-second of the process: less sensitive to a shared machine than wall time
            "tokens_per_cpu_s": round(result["tokens"] / result["cpu_seconds"], 1),
            # non-padding share of the positions the model computed (packing's and grouping's gain)
            "fill": round(result["tokens"] / max(result["positions"], 1), 3),
            "positions_per_s": round(result["positions"] / result["seconds"], 1)}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Each mode's median tokens/s (per wall and per CPU second) and peak, and its ratios to padded's medians."""
    medians = {mode: statistics.median(r["tokens_per_s"] for r in results) for mode, results in runs.items()}
    report = {mode: {"tokens_per_s_median": round(medians[mode], 1),
                     "tokens_per_cpu_s_median": round(statistics.median(r["tokens_per_cpu_s"] for r in results), 1),
                     "peak_mib_median": round(statistics.median(r["peak_mib"] for r in results), 1),
                     "runs": results} for mode, results in runs.items()}
    if "padded" in medians:
        report["ratio_to_padded"] = {mode: round(value / medians["padded"], 3) for mode, value in medians.items()
                                     if mode != "padded"}
        # by CPU time too: steadier than wall time on a shared machine, where other jobs stretch the wall clock
        cpu = {mode: report[mode]["tokens_per_cpu_s_median"] for mode in medians}
        report["ratio_to_padded_cpu"] = {mode: round(value / cpu["padded"], 3) for mode, value in cpu.items()
                                         if mode != "padded"}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["padded", "packed"], choices=list(MODES))
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of each mode (at least 3)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=2000, help="dataset rows (enough for every step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    parser.add_argument("--quick", action="store_true", help="a 2-layer hidden-128 model, 3 steps, 1 run each")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.steps, args.warmup = 1, 3, 1
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.runs):
        for mode in args.modes:
            runs[mode].append(measure(mode, args))
    settings = {key: getattr(args, key) for key in ("runs", "steps", "warmup", "batch_size", "max_seq_len",
                                                    "threads", "quick")}
    emit({"settings": {**settings, "model": QUICK_MODEL if args.quick else MODEL}, **summarise(runs)}, args.out)


if __name__ == "__main__":
    main()
