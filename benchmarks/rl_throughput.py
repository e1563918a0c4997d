"""RL throughput: GRPO's rollout modes side by side on the CPU example (grpo-tiny-reverse).

    python benchmarks/rl_throughput.py                          # 3 rounds of every setting, JSON to stdout
    python benchmarks/rl_throughput.py --rounds 5 --steps 40 --out result.json
    python benchmarks/rl_throughput.py --warm-start outputs/grpo-tiny-start/model

Settings: ``local`` (sync, generation in the learner: the baseline), ``local, padded learner``
(the same with ``method.padding_free: false``: the learner's rows right-padded, as before), and with Ray engine actors
``sync`` (lag 0), ``async`` (lag 1) and ``off_policy`` (lag 2), each on 1 and 2 engines; one
learner process (torch threads 1, engines 1 thread each). Each run is ``posttune train
grpo-tiny-reverse`` from the example's warm start for ``--steps`` steps, without evaluation or
checkpoints, in a fresh process; the settings alternate within each round (the order rotates each
round), so a busy neighbour slows all of them alike. From each run's ``metrics.jsonl``, the first
``--skip`` steps left out (actor start, first weights): step time = ``training_s`` +
``rollout_wait_s`` (the learner's wait for rollouts; for ``local`` it is generation in the
learner); steps per minute = 60 x steps / their summed time; learner idle = summed wait /
summed step time. The report gives each setting's medians over the rounds and its steps per
minute relative to ``local``.

On a 2-core machine the engines and the learner share the same cores, so overlap cannot make
the total work faster here; what the table shows is how much of the learner's step is spent
waiting, which is what the async modes exist to remove. On GPUs (engines and learners on their
own devices) the same overlap is a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from child import emit

SETTINGS = {
    "local": [],
    "local, padded learner": ["method.padding_free=false"],  # the learner's rows before padding_free
    **{f"{mode}, {engines} engine{'s' if engines > 1 else ''}":
       [f"method.mode={mode}", "method.generation=ray", f"method.ray_options.actors={engines}"]
       for mode in ("sync", "async", "off_policy") for engines in (1, 2)},
}


def prepare(path: Path) -> Path:
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "posttune_grpo.example", "prepare", "--out", str(path)], check=True)
    return path


def measure(warm_start: Path, overrides: list[str], steps: int, skip: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        run = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", "grpo-tiny-reverse",
                              f"model.path={warm_start}", f"checkpoint.output_dir={out}", f"train.max_steps={steps}",
                              "train.eval_every=null", "checkpoint.save_every=null", *overrides],
                             capture_output=True, text=True, env=env, check=False)
        if run.returncode != 0:
            raise SystemExit(f"run failed ({overrides}):\n{run.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()][skip:]
    waits = [r.get("rollout_wait_s", r.get("generation_s", 0.0)) for r in records]
    step_times = [r["training_s"] + wait for r, wait in zip(records, waits, strict=True)]
    return {"steps_per_min": 60 * len(records) / sum(step_times), "learner_idle": sum(waits) / sum(step_times),
            "reward": statistics.mean(r["reward"] for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the figures")
    parser.add_argument("--warm-start", type=Path, default=Path("outputs/grpo-tiny-start/model"))
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the settings to run (default: all; 'local' always runs: the others are compared to it)")
    parser.add_argument("--out")
    args = parser.parse_args()
    warm_start = prepare(args.warm_start.resolve())
    names = ["local", *(name for name in args.settings if name != "local")]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            runs[name].append(measure(warm_start, SETTINGS[name], args.steps, args.skip))
            print(f"round {round_ + 1}, {name}: {runs[name][-1]}", file=sys.stderr)
    base = statistics.median(r["steps_per_min"] for r in runs["local"])
    report = {"steps": args.steps, "skipped": args.skip, "rounds": args.rounds, "settings": {}}
    for name in names:
        per_min = statistics.median(r["steps_per_min"] for r in runs[name])
        report["settings"][name] = {
            "steps_per_min_median": round(per_min, 1), "vs_local": round(per_min / base, 2),
            "learner_idle_median": round(statistics.median(r["learner_idle"] for r in runs[name]), 3),
            "runs": [{k: round(v, 3) for k, v in r.items()} for r in runs[name]],
        }
    emit(report, args.out)


if __name__ == "__main__":
    main()
