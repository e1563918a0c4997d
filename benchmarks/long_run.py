"""Memory over a long run: does resident memory keep growing after warm-up? (issue: long-run stability)

    python benchmarks/long_run.py                          # JSON to stdout, a summary line per run to stderr
    python benchmarks/long_run.py --steps 1000 --runs sft lora --out result.json

Each run is a real ``posttune train`` of a bundled tiny config in a fresh process, for
``--steps`` optimizer steps with evaluation every 100 steps and a checkpoint every 250 (the
loop's every path: steps, evaluation, saves, pruning). The child records its peak resident
memory (``ru_maxrss``) and its current resident memory (``/proc/self/statm``) after steps 100
and ``--steps``. Peak growth between the two above 5% is a defect to fix: something is held
per step (metrics, graphs, checkpoints' tensors) that should not be.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from child import MIB, emit, run_child

CHILD = r'''
import json, os, resource, sys
import posttune.training.trainer as trainer
from posttune.cli.main import main

spec = json.loads(sys.argv[1])
marks = set(spec["marks"])
seen = {}
page = os.sysconf("SC_PAGE_SIZE")
step = trainer._optimizer_step

def record_memory(session, window, log, *rest):
    tokens = step(session, window, log, *rest)
    if session.step in marks:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * page
        seen[session.step] = {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "current": current}
    return tokens

trainer._optimizer_step = record_memory
status = main(["train", spec["config"], *spec["overrides"]])
print(json.dumps({"status": status, "seen": seen}))
'''

RUNS = {
    "sft": ("llama-demo-reverse", []),
    "lora": ("llama-demo-reverse", ["adapter.rank=8", "adapter.alpha=16", "train.lr=5e-3"]),
    "dpo": ("dpo-tiny-reverse", []),
}


def measure(name: str, steps: int, out_dir: str) -> dict:
    config, extra = RUNS[name]
    overrides = [*extra, f"train.max_steps={steps}", "train.eval_every=100", "checkpoint.save_every=250",
                 "checkpoint.keep_last=1", f"checkpoint.output_dir={out_dir}/{name}", "train.sample_prompts=[]"]
    result = run_child(CHILD, {"config": config, "overrides": overrides, "marks": [100, steps]})
    if result["status"] != 0:
        raise SystemExit(f"{name}: posttune train exited {result['status']}")
    early, late = result["seen"]["100"], result["seen"][str(steps)]
    report = {
        "config": config, "overrides": overrides,
        "peak_mib_at_100": round(early["peak"] / MIB, 1), f"peak_mib_at_{steps}": round(late["peak"] / MIB, 1),
        "current_mib_at_100": round(early["current"] / MIB, 1),
        f"current_mib_at_{steps}": round(late["current"] / MIB, 1),
        "peak_growth": round(late["peak"] / early["peak"] - 1, 4),
        "current_growth": round(late["current"] / early["current"] - 1, 4),
    }
    report["defect"] = report["peak_growth"] > 0.05
    print(f"{name}: peak {report['peak_mib_at_100']} -> {report[f'peak_mib_at_{steps}']} MiB "
          f"({report['peak_growth']:+.1%})", file=sys.stderr)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="posttune-long-run-") as tmp:
        report = {name: measure(name, args.steps, tmp) for name in args.runs}
    emit(report, args.out)
    if any(r["defect"] for r in report.values()):
        raise SystemExit("peak resident memory grew more than 5% between step 100 and the last step")


if __name__ == "__main__":
    main()
