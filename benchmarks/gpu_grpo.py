"""A GRPO step on one GPU, Qwen2.5-1.5B-shaped, with the `builtin` and the `vllm` engine (not a test).

    python benchmarks/gpu_grpo.py                       # 6 steps per engine, JSON to stdout
    python benchmarks/gpu_grpo.py --steps 10 --engines vllm --out result.json

Nothing is downloaded (the GPU machine reaches no hub): the policy is posttune-qwen's ``1.5b`` size
(Qwen2.5-1.5B's shape: hidden 1536, 28 layers, 12 query / 2 KV heads of 128, vocabulary 151936)
randomly initialised in bf16, the tokenizer is the GRPO example's (its ids are a subset of the
vocabulary), and the prompts are the example's. The method is the bundled
``qwen2.5-1.5b-grpo-gsm8k`` config's (group 8, temperature 1, token aggregation, clip-higher,
batch 8 prompts) with ``max_new_tokens`` (default 512) and, since a random policy never writes an
EOS, every completion runs to that length: a GSM8K step's worst case. The reward is the example's
``exact_answer`` (0 for a random policy; the loss still runs, on zero advantages).

Each engine runs `posttune train` in its own process: ``--steps`` steps, the first dropped as warm-up.
Reported per engine from metrics.jsonl: the median ``generation_tokens_per_s``, ``generation_s``,
``training_s``, step time (their sum) and the peak GPU memory the trainer reports; the ratios are
vllm / builtin. Without CUDA it refuses in one line (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINES = ("builtin", "vllm")


def config(engine: str, args: argparse.Namespace, out: Path) -> dict:
    import posttune_grpo

    example = Path(posttune_grpo.__file__).parent / "example"
    return {
        "model": {"family": "qwen2", "size": "1.5b", "dtype": "bf16"},
        "tokenizer": {"path": str(example / "tokenizer")},
        "method": {"name": "grpo", "group_size": 8, "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                   "rewards": [{"name": "exact_answer"}], "scale_rewards": "group", "loss_aggregation": "token",
                   "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0, "engine": engine,
                   **({"engine_options": {"kv_cache_gib": args.kv_cache_gib}} if engine == "vllm" else {})},
        "data": {"train": {"path": str(example / "prompts_train.jsonl"), "format": "prompt"}},
        "train": {"max_steps": args.steps, "batch_size": 8, "lr": 1e-6, "scheduler": "constant", "device": "cuda",
                  "max_grad_norm": 1.0},
        "checkpoint": {"output_dir": str(out)},
    }


def run(engine: str, args: argparse.Namespace) -> dict:
    import yaml

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        path = Path(folder) / "run.yaml"
        path.write_text(yaml.safe_dump(config(engine, args, out)))
        done = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", str(path)], text=True,
                              capture_output=True)
        if done.returncode != 0:
            return {"error": done.stderr[-2000:]}
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    median = {key: statistics.median(r[key] for r in steps) for key in
              ("generation_tokens_per_s", "generation_s", "training_s")}
    return {**{k: round(v, 3) for k, v in median.items()},
            "step_s": round(median["generation_s"] + median["training_s"], 3),
            "peak_memory_mib": max(r.get("peak_memory_mib", 0.0) for r in steps), "steps_measured": len(steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per engine (the first is dropped)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=float, default=20.0)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_grpo.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    report: dict = {"device": torch.cuda.get_device_name(0), "max_new_tokens": args.max_new_tokens,
                    **{engine: run(engine, args) for engine in args.engines}}
    if all("step_s" in report.get(engine, {}) for engine in ENGINES):
        report["ratios"] = {"generation_tokens_per_s": round(report["vllm"]["generation_tokens_per_s"] /
                                                             report["builtin"]["generation_tokens_per_s"], 2),
                            "step_s": round(report["vllm"]["step_s"] / report["builtin"]["step_s"], 2)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
