"""Used by tox's `isolation` env: `posttune plugins --json` in this venv lists exactly these distributions.

    python check_plugins.py posttune posttune-template
"""

import json
import subprocess
import sys
from pathlib import Path


def main(expected: list[str]) -> int:
    posttune = Path(sys.executable).with_name("posttune")
    run = subprocess.run([str(posttune), "plugins", "--json"], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        print(f"posttune plugins failed ({run.returncode}): {run.stderr}", file=sys.stderr)
        return 1
    report = json.loads(run.stdout)
    found = {plugin["distribution"] for plugin in report["plugins"]}
    errors = [f"{p['distribution']}: {p['error']}" for p in report["plugins"] if p["error"]]
    problems = []
    if found != set(expected):
        problems.append(f"distributions: expected {sorted(expected)}, found {sorted(found)}")
    problems += errors + report["problems"]
    for plugin in report["plugins"]:
        names = ", ".join(f"{kind}: {' '.join(items)}" for kind, items in plugin["registers"].items())
        print(f"{plugin['distribution']} {plugin['version']} ({plugin['name']}): {names}")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
