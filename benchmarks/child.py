"""What the benchmark scripts share: a measurement in a fresh child process, and the report.

Each measurement runs in its own ``python -c`` child so that its peak resident memory
(``ru_maxrss``) is its own; the child prints one JSON line last.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

MIB = 2**20


def run_child(code: str, spec: dict, *, env: dict | None = None) -> dict:
    """Run ``code`` with the JSON ``spec`` as its argument; its last stdout line, parsed."""
    run = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                         check=False, env=env)
    if run.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def memory_and_time(result: dict) -> dict:
    """A child's ``peak``/``setup_peak`` bytes and ``step_seconds`` as the reports quote them."""
    return {
        "peak_mib": round(result["peak"] / MIB, 1),
        "setup_peak_mib": round(result["setup_peak"] / MIB, 1),
        "step_peak_mib": round((result["peak"] - result["setup_peak"]) / MIB, 1),
        "step_seconds_median": round(statistics.median(result["step_seconds"]), 3),
        "step_seconds": [round(t, 3) for t in result["step_seconds"]],
    }


def emit(report: dict, out: str | None) -> None:
    """Print the report as JSON, and write it to ``out`` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
