"""How long the CLI takes to answer: `posttune --help`, `ls`, `validate` and `generate` on the demo model.

    python benchmarks/cli_start.py                       # trains a 1-step demo model to generate with
    python benchmarks/cli_start.py --model outputs/llama-demo-reverse/model --runs 5
    python benchmarks/cli_start.py --runs 5 --out benchmarks/results/cli_start.json

Each command runs ``--runs`` times in a fresh process (imports included, as a user types it);
prints JSON with every wall time and the median per command. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

DEMO = "llama-demo-reverse"


def timed(args: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "posttune.cli.main", *args], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"posttune {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", help="a trained demo model folder (default: the demo's model after 1 step)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory()
    if args.model is None:  # the demo's shape and tokenizer; what it says does not matter here
        args.model = f"{scratch.name}/demo/model"
        timed(["train", DEMO, f"checkpoint.output_dir={scratch.name}/demo", "train.max_steps=1",
               "train.eval_every=null", "train.sample_prompts=[]"])
    commands = {"--help": ["--help"], "ls": ["ls"], "validate": ["validate", DEMO, "checkpoint.overwrite=true"],
                "generate": ["generate", "--model", args.model, "--chat", "--prompt", "Reverse: KERNEL",
                             "--max-new-tokens", "8"]}
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):  # interleaved, so a busy moment touches every command alike
        for name, command in commands.items():
            seconds[name].append(round(timed(command), 3))
    report = json.dumps({name: {"median_s": round(statistics.median(times), 3), "seconds": times}
                         for name, times in seconds.items()}, indent=2)
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report + "\n")


if __name__ == "__main__":
    main()
