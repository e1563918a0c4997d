"""The `isolation` tox env: distributions install on their own, and plugins appear as installed.

One brand-new venv goes through these states; after each install (or uninstall), `posttune plugins`
lists exactly the distributions then installed. One venv rather than one per state: each costs a
torch install, and `pip uninstall` removes a distribution's entry points with its dist-info.

1. `core` alone -> the built-ins alone.
2. + `posttune_models/qwen` -> exactly `posttune` and `posttune-qwen`; `posttune ls families` shows
   qwen2 and qwen3 but no llama or gemma, and a config naming family `gemma2` fails validation with
   exit status 2 and the `pip install posttune-gemma` hint.
3. - posttune-qwen, + `plugins/template` -> its names appear, and its own tests pass there (a
   third-party plugin's tests with nothing but posttune, the plugin and pytest installed: it may
   import only the public surface).
4. + `posttune_models/llama` -> it appears too.
5. - posttune-template, + `posttune_methods/dpo`, `posttune_methods/kd` and `plugins/generate` (its engine,
   which kd depends on; no posttune-sft) -> a
   config naming `activation_checkpointing` is refused with the `pip install posttune-memory` hint
   (the core brings no memory technique), a shortened `posttune train dpo-tiny-reverse` runs end to
   end, and so do the distillation example's teacher and a shortened `posttune train kd-tiny-reverse`
   (the teacher's data and tokenizer are posttune-llama's package data: a wheel install must ship them);
   `posttune generate` (posttune-generate's command) completes a prompt with the distilled model. In state
   2, without posttune-generate, the same command is refused naming `pip install posttune-generate`.

posttune, posttune-qwen and posttune-grpo alone (no Ray) training GRPO is the `wheels` env's check
(tests/packaging/wheels.py), which installs them from their wheels: the same three from source
folders here would only repeat it.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
GEMMA2_CONFIG = """\
model: {family: gemma2, size: tiny}
method: {name: sft}
data: {train: {path: train.jsonl, format: chat}}
"""


def template_tests(env: Path, tmp: Path) -> list[str]:
    """The template plugin's own test suite, in the venv that holds only posttune and the template."""
    print("== pytest plugins/template/tests (core + template only)", flush=True)
    python = str(env / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), "pytest>=8"], check=True)
    code = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "plugins/template/tests")], cwd=ROOT / "plugins/template").returncode
    return [] if code == 0 else [f"plugins/template's tests failed (pytest exit {code})"]


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
    generate = subprocess.run([posttune, "generate", "--model", "x", "--prompt", "hi"], capture_output=True, text=True)
    print(f"posttune generate -> {generate.returncode}: {generate.stderr.strip()}")
    if generate.returncode != 2 or "pip install posttune-generate" not in generate.stderr:
        problems.append(f"posttune generate without posttune-generate: expected exit 2 and 'pip install "
                        f"posttune-generate', got {generate.returncode}: {generate.stdout}{generate.stderr}")
    return problems


def check_dpo_and_kd_without_sft(env: Path, tmp: Path) -> list[str]:
    """Shortened `posttune train dpo-tiny-reverse` and the distillation example in a venv without posttune-sft."""
    python, posttune = str(env / "bin" / "python"), str(env / "bin" / "posttune")
    validate = subprocess.run([posttune, "validate", "dpo-tiny-reverse", "memory=[activation_checkpointing]"], cwd=tmp,
                              capture_output=True, text=True)
    print(f"posttune validate dpo-tiny-reverse memory=[activation_checkpointing] -> {validate.returncode}: "
          f"{validate.stderr.strip()}")
    if validate.returncode != 2 or "pip install posttune-memory" not in validate.stderr:
        return [f"a memory technique without posttune-memory: expected exit 2 and 'pip install posttune-memory', got "
                f"{validate.returncode}: {validate.stdout}{validate.stderr}"]
    train = subprocess.run([posttune, "train", "dpo-tiny-reverse", "train.max_steps=20",
                            "train.eval_every=10", f"checkpoint.output_dir={tmp}/dpo"], cwd=tmp,
                           capture_output=True, text=True)
    print(train.stdout[-800:], end="")
    if train.returncode != 0 or not (tmp / "dpo" / "model" / "config.json").is_file():
        return [f"posttune train dpo-tiny-reverse -> {train.returncode}: {train.stderr[-2000:]}"]
    teacher = tmp / "teacher"
    prepare = subprocess.run([python, "-m", "posttune_kd.example", "prepare-teacher", "--steps", "20",
                              "--out", str(teacher)], cwd=tmp, capture_output=True, text=True)
    if prepare.returncode != 0:
        return [f"python -m posttune_kd.example prepare-teacher -> {prepare.returncode}: {prepare.stderr[-2000:]}"]
    train = subprocess.run([posttune, "train", "kd-tiny-reverse", f"teacher.path={teacher}", "train.max_steps=4",
                            "train.eval_every=2", "method.on_policy_fraction=0.5", f"checkpoint.output_dir={tmp}/kd"],
                           cwd=tmp, capture_output=True, text=True)
    print(train.stdout[-800:], end="")
    if train.returncode != 0 or not (tmp / "kd" / "model" / "config.json").is_file():
        return [f"posttune train kd-tiny-reverse -> {train.returncode}: {train.stderr[-2000:]}"]
    generate = subprocess.run([posttune, "generate", "--model", str(tmp / "kd" / "model"), "--chat", "--prompt",
                               "Reverse: KERNEL", "--max-new-tokens", "8", "--show-ids"], cwd=tmp, capture_output=True,
                              text=True)
    print(f"posttune generate (posttune-generate's command) -> {generate.returncode}: {generate.stdout.strip()!r}")
    if generate.returncode != 0:  # a 4-step student may well answer nothing but its end of turn: what it says is free
        return [f"posttune generate on the distilled model -> {generate.returncode}: {generate.stderr[-2000:]}"]
    return []


@dataclass(frozen=True)
class State:
    """One state of the venv: what to uninstall, then install, the distributions then listed, and
    the checks run there (each returns its problems)."""

    title: str
    install: tuple[str, ...]
    expected: tuple[str, ...]
    uninstall: tuple[str, ...] = ()
    check: Callable[[Path, Path], list[str]] | None = None


STATES = [
    State("core alone", ("core",), ("posttune",)),
    State("core and posttune-qwen alone", ("posttune_models/qwen",), ("posttune", "posttune-qwen"),
          check=check_qwen_alone),
    State("core and the template plugin", ("plugins/template",), ("posttune", "posttune-template"),
          uninstall=("posttune-qwen",), check=template_tests),
    State("and a first-party plugin", ("posttune_models/llama",), ("posttune", "posttune-template", "posttune-llama")),
    State("core, posttune-llama, posttune-dpo and posttune-kd (no posttune-sft)",
          ("plugins/generate", "posttune_methods/dpo", "posttune_methods/kd"),
          ("posttune", "posttune-llama", "posttune-generate", "posttune-dpo", "posttune-kd"),
          uninstall=("posttune-template",), check=check_dpo_and_kd_without_sft),
]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="posttune-isolation-") as tmp:
        env = Path(tmp) / "venv"
        venv.create(env, with_pip=True)
        python = str(env / "bin" / "python")
        for state in STATES:
            print(f"== {state.title}", flush=True)
            if state.uninstall:
                subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *state.uninstall], check=True)
            paths = [str(ROOT / folder) for folder in state.install]
            subprocess.run([python, "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), *paths], check=True)
            listed = subprocess.run([python, str(ROOT / "tests/isolation/check_plugins.py"), *state.expected])
            problems = [] if listed.returncode == 0 else [f"posttune plugins after '{state.title}' (above)"]
            if not problems and state.check is not None:
                problems = state.check(env, Path(tmp))
            for problem in problems:
                print(f"FAIL: {problem}", file=sys.stderr)
            if problems:
                return 1
    print("isolation: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
