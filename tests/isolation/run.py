"""The `isolation` tox env: distributions install on their own, and plugins appear as installed.

Scenario 1, in a brand-new venv: install only `core` -> `posttune plugins` lists the built-ins
alone; add `plugins/template` -> its names appear; add one first-party plugin -> it appears too.

Scenario 2, in another brand-new venv: install `core` and `posttune_models/qwen` alone ->
exactly `posttune` and `posttune-qwen` are listed, `posttune ls families` shows qwen2 and qwen3
but no llama or gemma, and a config naming family `gemma2` fails validation with exit status 2
and the `pip install posttune-gemma` hint.
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
QWEN_ALONE = [(["core", "posttune_models/qwen"], ["posttune", "posttune-qwen"])]
GEMMA2_CONFIG = """\
model: {family: gemma2, size: tiny}
method: {name: sft}
data: {train: {path: train.jsonl, format: chat}}
"""


def install_steps(env: Path, steps: list[tuple[list[str], list[str]]]) -> int:
    """Create a fresh venv at ``env``; after each install, the listed distributions are exactly these."""
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    for folders, expected in steps:
        paths = [str(ROOT / folder) for folder in folders]
        print(f"== pip install {' '.join(folders)}", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), *paths], check=True)
        check = subprocess.run([str(python), str(ROOT / "tests/isolation/check_plugins.py"), *expected])
        if check.returncode != 0:
            return check.returncode
    return 0


def check_qwen_alone(env: Path, tmp: Path) -> list[str]:
    """Problems with the families and the missing-plugin hint in a venv holding core + qwen only."""
    posttune = str(env / "bin" / "posttune")
    problems = []
    families = subprocess.run([posttune, "ls", "families"], capture_output=True, text=True)
    names = {line.split()[0] for line in families.stdout.splitlines() if line.strip()}
    print(families.stdout, end="")
    if families.returncode != 0 or not {"qwen2", "qwen3"} <= names:
        problems.append(f"posttune ls families: expected qwen2 and qwen3, got {sorted(names)} {families.stderr}")
    if names & {"llama", "mistral", "gemma", "gemma2", "gemma3"}:
        problems.append(f"posttune ls families lists families of distributions not installed: {sorted(names)}")
    config = tmp / "gemma2.yaml"
    config.write_text(GEMMA2_CONFIG)
    validate = subprocess.run([posttune, "validate", str(config)], capture_output=True, text=True, cwd=tmp)
    print(f"posttune validate gemma2.yaml -> {validate.returncode}: {validate.stderr.strip()}")
    if validate.returncode != 2 or "pip install posttune-gemma" not in validate.stderr:
        problems.append(f"posttune validate on family gemma2: expected exit 2 and 'pip install posttune-gemma', "
                        f"got {validate.returncode}: {validate.stdout}{validate.stderr}")
    return problems


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="posttune-isolation-") as tmp:
        print("== scenario: distributions one by one", flush=True)
        code = install_steps(Path(tmp) / "venv", STEPS)
        if code != 0:
            return code
    with tempfile.TemporaryDirectory(prefix="posttune-isolation-qwen-") as tmp:
        print("== scenario: core and posttune-qwen alone", flush=True)
        env = Path(tmp) / "venv"
        code = install_steps(env, QWEN_ALONE)
        if code != 0:
            return code
        problems = check_qwen_alone(env, Path(tmp))
        for problem in problems:
            print(f"FAIL: {problem}", file=sys.stderr)
        if problems:
            return 1
    print("isolation: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
