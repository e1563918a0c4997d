"""The `isolation` tox env: distributions install on their own, and plugins appear as installed.

In a brand-new venv: install only `core` -> `posttune plugins` lists the built-ins alone; add
`plugins/template` -> its names appear; add one first-party plugin -> it appears too.
"""

import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
STEPS = [
    (["core"], ["posttune"]),
    (["plugins/template"], ["posttune", "posttune-template"]),
    (["posttune_models/llama"], ["posttune", "posttune-template", "posttune-llama"]),
]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="posttune-isolation-") as tmp:
        env = Path(tmp) / "venv"
        venv.create(env, with_pip=True)
        python = env / "bin" / "python"
        for folders, expected in STEPS:
            paths = [str(ROOT / folder) for folder in folders]
            print(f"== pip install {' '.join(folders)}", flush=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), *paths], check=True)
            check = subprocess.run([str(python), str(ROOT / "tests/isolation/check_plugins.py"), *expected])
            if check.returncode != 0:
                return check.returncode
    print("isolation: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
