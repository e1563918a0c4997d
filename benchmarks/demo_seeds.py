"""The README demo over seeds and thread counts: does every run learn, and how long does it take?

    python benchmarks/demo_seeds.py                           # seeds 0-4 x threads 1, 2 (10 runs)
    python benchmarks/demo_seeds.py --seeds 0 1 --threads 2 -- train.lr=2e-3   # overrides after --

Each run is `posttune train llama-demo-reverse` in a fresh process with OMP_NUM_THREADS set,
then `posttune_llama.demo.check` on the saved model: exact-match accuracy on the validation
split (strings never trained on) and the three sample prompts. One JSON line per run, then a
summary line. Runs go one after another (``--jobs 1``) so that their times are comparable; with
``--jobs 2`` and one thread each, two share the 2 cores (times are then not the README's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_one(seed: int, threads: int, overrides: list[str], root: Path) -> dict:
    out = root / f"seed{seed}-threads{threads}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    train = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", "llama-demo-reverse",
                            f"checkpoint.output_dir={out}", f"train.seed={seed}", *overrides],
                           capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    result: dict = {"seed": seed, "threads": threads, "train_s": round(seconds, 1)}
    if train.returncode != 0:
        return {**result, "error": train.stderr.strip().splitlines()[-1:]}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [m["val_loss"] for m in metrics if "val_loss" in m]
    validation = [f"--validation={o.split('=', 1)[1]}" for o in overrides if o.startswith("data.validation.path=")]
    check = subprocess.run([sys.executable, "-m", "posttune_llama.demo.check", str(out / "model"), *validation],
                           capture_output=True, text=True, env=env)
    if check.returncode != 0:
        return {**result, "error": check.stderr.strip().splitlines()[-1:]}
    return {**result, "final_val_loss": round(val[-1], 5) if val else None,
            "val_losses": [round(v, 4) for v in val], **json.loads(check.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (times are comparable only with 1)")
    parser.add_argument("--keep", help="keep the runs' output directories under this folder")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="demo-seeds-"))
    cases = [(seed, threads) for threads in args.threads for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = []
        for result in pool.map(lambda case: run_one(*case, args.overrides, root), cases):
            print(json.dumps(result), flush=True)
            results.append(result)
    done = [r for r in results if "error" not in r]
    print(json.dumps({
        "runs": len(results), "failed": len(results) - len(done),
        "all_samples_right": sum(r["samples_right"] for r in done),
        "exact_match_min": min((r["exact_match"] for r in done), default=None),
        "exact_match_median": statistics.median(r["exact_match"] for r in done) if done else None,
        "final_val_loss_max": max((r["final_val_loss"] for r in done), default=None),
        "train_s_median": statistics.median(r["train_s"] for r in done) if done else None,
        "overrides": args.overrides,
    }))


if __name__ == "__main__":
    main()
