"""One benchmark under two revisions of posttune, alternating: what a change did, measured side by side.

    python benchmarks/revisions.py 2416abd HEAD --rounds 4 -- \
        python benchmarks/rl_throughput.py --settings local --rounds 1 --steps 30
    python benchmarks/revisions.py HEAD~1 HEAD --out result.json -- python benchmarks/labelled_head.py --rounds 1

Each revision is checked out once into a temporary git worktree; every run then puts that worktree's
packages (the core and every distribution folder) first on ``PYTHONPATH``, so the installed
distributions' entry points load that revision's code, while the benchmark script itself is this
checkout's (the same harness for both). The command must print one JSON object on stdout, as the
scripts here do. Runs alternate (A, B, B, A, A, B, ...), so a busy neighbour slows both alike. The
report: per revision, the median of every number in the command's JSON (nested keys joined with
``.``), and the ratio second / first. A revision whose dependencies differ from what is installed
(a new distribution, a new requirement) cannot be measured this way.
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

ROOT = Path(__file__).resolve().parent.parent
#: folders holding a distribution's package directory (each on PYTHONPATH)
DISTRIBUTION_PARENTS = ("posttune_models", "posttune_methods", "posttune_parallel", "posttune_trackers", "plugins")


def package_paths(tree: Path) -> list[str]:
    """The core and every distribution folder of a checkout: where their import packages live."""
    paths = [tree / "core"]
    for parent in DISTRIBUTION_PARENTS:
        paths += sorted(folder for folder in (tree / parent).glob("*") if (folder / "pyproject.toml").is_file())
    return [str(path) for path in paths]


def numbers(report: object, prefix: str = "") -> dict[str, float]:
    """Every int or float in a JSON report, keyed by its path (``a.b.0``)."""
    if isinstance(report, bool):
        return {}
    if isinstance(report, (int, float)):
        return {prefix: float(report)}
    items = report.items() if isinstance(report, dict) else enumerate(report) if isinstance(report, list) else ()
    found: dict[str, float] = {}
    for key, value in items:
        found.update(numbers(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def run(command: list[str], tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(package_paths(tree) + [os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"revisions.py: the command failed under {tree}:\n{done.stderr[-3000:]}")
    return numbers(json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the benchmark command after --")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if command[0] in ("python", "python3"):  # this interpreter: the venv posttune is installed in
        command = [sys.executable, *command[1:]]
    with tempfile.TemporaryDirectory(prefix="posttune-revisions-") as scratch:
        trees = {}
        for name in (args.first, args.second):
            tree = Path(scratch) / f"tree-{len(trees)}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), name],
                           check=True)
            trees[name] = tree
        try:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            order = list(trees)
            for round_index in range(args.rounds):
                for name in order if round_index % 2 == 0 else order[::-1]:
                    results[name].append(run(command, trees[name]))
                    print(f"round {round_index} {name}: done", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    first, second = args.first, args.second
    keys = [key for key in results[first][0] if all(key in r for runs in results.values() for r in runs)]
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in keys} for name, runs in results.items()}
    report = {"command": command, "rounds": args.rounds, "revisions": [first, second], "median": medians,
              "ratio_second_over_first": {key: round(medians[second][key] / medians[first][key], 4)
                                          for key in keys if medians[first][key]}}
    emit(report, args.out)


if __name__ == "__main__":
    main()
