"""The `isolation` tox env: distributions install on their own, and plugins appear as installed.

Scenario 1, in a brand-new venv: install only `core` -> `posttune plugins` lists the built-ins
alone; add `plugins/template` -> its names appear, and its own tests pass there (a third-party
plugin's tests with nothing but posttune, the plugin and pytest installed: it may import only the
public surface); add one first-party plugin -> it appears too.

Scenario 2, in another brand-new venv: install `core` and `posttune_models/qwen` alone ->
exactly `posttune` and `posttune-qwen` are listed, `posttune ls families` shows qwen2 and qwen3
but no llama or gemma, and a config naming family `gemma2` fails validation with exit status 2
and the `pip install posttune-gemma` hint.

Scenario 3, in another brand-new venv: `core`, `posttune_models/llama`, `posttune_methods/dpo` and
`posttune_methods/kd` (no posttune-sft) -> a shortened `posttune train dpo-tiny-reverse` runs end
to end, and so do the distillation example's teacher and a shortened `posttune train kd-tiny-reverse`
(the teacher's data and tokenizer are posttune-llama's package data: a wheel install must ship them).

Scenario 4, in another brand-new venv: `core`, `posttune_models/qwen` and `posttune_methods/grpo`
(no Ray) -> the GRPO example's warm start and a shortened `posttune train grpo-tiny-reverse`.
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
GRPO_WITH_QWEN = [(["core", "posttune_models/qwen", "posttune_methods/grpo"],
                   ["posttune", "posttune-qwen", "posttune-grpo"])]
DPO_AND_KD_WITHOUT_SFT = [(["core", "posttune_models/llama", "posttune_methods/dpo", "posttune_methods/kd"],
                           ["posttune", "posttune-llama", "posttune-dpo", "posttune-kd"])]
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
        if "plugins/template" in folders:
            code = run_template_tests(python)
            if code != 0:
                return code
    return 0


def run_template_tests(python: Path) -> int:
    """The template plugin's own test suite, in the venv that holds only posttune and the template."""
    print("== pytest plugins/template/tests (core + template only)", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), "pytest>=8"], check=True)
    return subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "plugins/template/tests")], cwd=ROOT / "plugins/template").returncode


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


def check_dpo_and_kd_without_sft(env: Path, tmp: Path) -> list[str]:
    """Shortened `posttune train dpo-tiny-reverse` and the distillation example in a venv without posttune-sft."""
    python, posttune = str(env / "bin" / "python"), str(env / "bin" / "posttune")
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
    return []


def check_grpo_with_qwen(env: Path, tmp: Path) -> list[str]:
    """The GRPO CPU example, shortened, with nothing but core, posttune-qwen and posttune-grpo."""
    python, posttune = str(env / "bin" / "python"), str(env / "bin" / "posttune")
    start = tmp / "start"
    prepare = subprocess.run([python, "-m", "posttune_grpo.example", "prepare", "--steps", "20", "--out", str(start)],
                             cwd=tmp, capture_output=True, text=True)
    if prepare.returncode != 0:
        return [f"python -m posttune_grpo.example prepare -> {prepare.returncode}: {prepare.stderr[-2000:]}"]
    train = subprocess.run([posttune, "train", "grpo-tiny-reverse", f"model.path={start}", "train.max_steps=4",
                            "train.eval_every=2", f"checkpoint.output_dir={tmp}/grpo"], cwd=tmp,
                           capture_output=True, text=True)
    print(train.stdout[-800:], end="")
    if train.returncode != 0 or not (tmp / "grpo" / "model" / "config.json").is_file():
        return [f"posttune train grpo-tiny-reverse -> {train.returncode}: {train.stderr[-2000:]}"]
    return []


#: (what it shows, the install steps, the checks run in that venv afterwards)
SCENARIOS = [
    ("distributions one by one", STEPS, None),
    ("core and posttune-qwen alone", QWEN_ALONE, check_qwen_alone),
    ("core, posttune-llama, posttune-dpo and posttune-kd (no posttune-sft)", DPO_AND_KD_WITHOUT_SFT,
     check_dpo_and_kd_without_sft),
    ("core, posttune-qwen and posttune-grpo", GRPO_WITH_QWEN, check_grpo_with_qwen),
]


def main() -> int:
    for title, steps, check in SCENARIOS:
        with tempfile.TemporaryDirectory(prefix="posttune-isolation-") as tmp:
            print(f"== scenario: {title}", flush=True)
            env = Path(tmp) / "venv"
            code = install_steps(env, steps)
            if code != 0:
                return code
            problems = check(env, Path(tmp)) if check is not None else []
            for problem in problems:
                print(f"FAIL: {problem}", file=sys.stderr)
            if problems:
                return 1
    print("isolation: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
