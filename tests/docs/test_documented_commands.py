"""Every command README.md and docs/ show is run here (or is in NOT_RUN with the reason), and the
output they quote is compared with what the command prints today.

How a documented command is checked depends on what it is:
- a synopsis (`posttune train CONFIG [k=v ...]`, a bare `posttune plan`): the subcommand exists and
  every `--flag` it names is in that subcommand's `--help`;
- an install line (`pip install ...`, `tox`): every local path is a distribution, every extra and
  every `posttune-*` name exists (CI itself runs the README's `tox`, and the isolation env installs);
- anything else is run, in SCENARIOS below, in a scratch directory, in order, with the installed
  plugins. A run that would take minutes or need the hub gets arguments appended (SHORT/LOCAL: fewer
  steps, a tiny local model) - never different ones. A `$ command` block's quoted output must match
  (a `...` line skips lines; `...` inside a line matches anything; runs of spaces are one space).
- every `posttune: error:` line the docs quote is produced by the command in ERRORS (or by the test
  named in ELSEWHERE) and compared with it.
A new command in the docs fails `test_every_documented_command_is_checked` until it is added here.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from doc_blocks import ROOT, Shown, block_commands, quoted_errors, span_commands, transcripts

BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
       "COLUMNS": "200"}

#: a tiny local Llama in place of a hub checkpoint and hub data: appended after the config
LOCAL = ("model.path=null model.size=tiny model.dtype=fp32 tokenizer.path=package:posttune_llama/demo/tokenizer "
         "model.build_overrides.vocab_size=384 data.train.path=package:posttune_llama/demo/reverse_train.jsonl "
         "data.train.format=chat data.max_seq_len=64 method.packing=false train.batch_size=2 train.grad_accum_steps=1 "
         "checkpoint.save_merged=false")
SHORT = "train.max_steps=2 train.eval_every=null"
#: a scenario step that only prepares what a documented command needs (not itself documented)
SETUP = ": set-up &&"
#: a scenario step that copies trained runs in from PREPARE (trained once per module, not per scenario):
#: "runs/sft runs/lora" copies both as they are, "runs/lora:OUTPUT_DIR" copies runs/lora as OUTPUT_DIR
PREPARED = ": prepared"
DEMO_DATA = "$(python -c 'import os, posttune_llama; print(os.path.dirname(posttune_llama.__file__))')/demo"

#: what PREPARED copies from, as the set-up steps of the quantize, eval and merge scenarios trained it: the
#: demo shortened (runs/sft), and LoRA on that model (runs/lora)
PREPARE = (f"posttune train llama-demo-reverse checkpoint.output_dir=runs/sft {SHORT}",
           f"posttune train llama-demo-reverse checkpoint.output_dir=runs/lora model.path=runs/sft/model "
           f"adapter.kind=lora {SHORT}")
#: docs/eval.md's local task, as its YAML block shows it (the data path made absolute), with three rows
CAPITALS_TASK = """
import json, pathlib, re
block = pathlib.Path({eval_md!r}).read_text().split("```yaml", 1)[1].split("```", 1)[0]
pathlib.Path("tasks/capitals.yaml").write_text(re.sub(r"/abs/path/to/capitals.jsonl.*",
                                                      str(pathlib.Path("capitals.jsonl").resolve()), block))
rows = [("France", ["Paris", "Rome"], 0), ("Italy", ["Paris", "Rome"], 1), ("Spain", ["Lisbon", "Madrid"], 1)]
pathlib.Path("capitals.jsonl").write_text("".join(
    json.dumps({{"question": f"The capital of {{c}}?", "choices": ch, "label": l}}) + "\\n" for c, ch, l in rows))
""".format(eval_md=str(ROOT / "docs" / "eval.md"))

#: scenario -> the documented commands it runs, in order, each with what is appended (or inserted
#: after the config for `posttune train/plan/validate`, so the documented overrides still win)
SCENARIOS: dict[str, list[tuple[str, str]]] = {
    "listing": [
        ("posttune plugins", ""), ("posttune --version", ""), ("posttune ls", ""), ("posttune ls configs", ""),
        ("posttune ls families", ""), ("posttune ls methods", ""), ("posttune ls plans", ""),
        ("posttune ls memory", ""), ("posttune ls datasets", ""), ("posttune ls rewards", ""),
        ("posttune ls engines", ""), ("posttune ls --json methods", ""), ("posttune config keys", ""),
        ("posttune ls loggers", ""), ("posttune ls adapters", ""),
        ("posttune config keys logging_options", ""), ("posttune validate llama-demo-reverse", ""),
        ("posttune preview llama-demo-reverse --rows 1", ""),
    ],
    "training quick start (docs/training.md)": [
        ("posttune cp llama3.2-1b-lora my.yaml", ""),
        ("posttune plan my.yaml", ""),
        ("posttune train my.yaml train.lr=1e-4", f"{LOCAL} {SHORT}"),
        ("posttune train my.yaml train.lr=1e-4 --trust-components", f"{LOCAL} {SHORT} checkpoint.overwrite=true"),
        ("posttune train my.yaml", f"{LOCAL} {SHORT} checkpoint.overwrite=true"),
        ("posttune train my.yaml train.max_steps=4 checkpoint.save_every=2",
         f"{LOCAL} train.eval_every=null checkpoint.overwrite=true"),
        ("posttune train my.yaml train.max_steps=6 checkpoint.save_every=2 checkpoint.resume=latest",
         f"{LOCAL} train.eval_every=null"),
    ],
    "config.md overrides": [
        (f"{SETUP} posttune cp llama3.2-1b-lora my-run.yaml && cp {DEMO_DATA}/reverse_train.jsonl other.jsonl", ""),
        ("posttune train my-run.yaml train.lr=1e-4 train.optimizer._component_=torch.optim.SGD "
         "memory=[activation_checkpointing] ~adapter data.train.path=other.jsonl", f"{LOCAL} {SHORT}"),
    ],
    "README demo": [
        ("posttune train llama-demo-reverse", SHORT),
        ('posttune generate --model outputs/llama-demo-reverse/model --chat --prompt "Reverse: KERNEL"', ""),
        ("python -m posttune_llama.demo.check outputs/llama-demo-reverse/model", ""),
    ],
    "DPO (README, docs/dpo.md)": [
        ("posttune plan dpo-tiny-reverse", ""),
        ("posttune plan dpo-tiny-reverse adapter.kind=lora", ""),
        ("posttune train dpo-tiny-reverse", SHORT),
        ("posttune plot outputs/dpo-tiny-reverse", ""),
        ("posttune train kto-tiny-reverse", SHORT),
    ],
    "GRPO (README, docs/grpo.md)": [
        ("python -m posttune_grpo.example prepare", "--steps 20"),
        ("posttune train grpo-tiny-reverse", SHORT),
        ("posttune plot outputs/grpo-tiny-reverse", ""),
        ("posttune train grpo-tiny-reverse method.mode=async", f"{SHORT} checkpoint.overwrite=true"),
    ],
    "KD (README, docs/kd.md)": [
        ("python -m posttune_kd.example prepare-teacher", "--steps 20"),
        ("posttune plan kd-tiny-reverse", ""),
        ("posttune train kd-tiny-reverse", SHORT),
    ],
    "quantize (docs/quantize.md)": [
        (f"{PREPARED} runs/sft runs/lora", ""),
        ("posttune quantize --model runs/sft/model -o runs/sft/int8", ""),
        ("posttune quantize --adapter runs/lora/adapter -o runs/lora/int8", ""),
        ("posttune quantize --model runs/sft/model --scheme int4_weight_only --group-size 64 -o runs/sft/int4", ""),
    ],
    "eval with a local task (docs/eval.md)": [
        (f"{PREPARED} runs/sft", ""),
        (f"{SETUP} mkdir tasks && python -c {shlex.quote(CAPITALS_TASK)}", ""),
        ("posttune eval --model runs/sft/model --tasks capitals --include-path tasks/ --output capitals.json", ""),
        ("posttune eval --model runs/sft/model --tasks capitals --include-path tasks/ --num-fewshot 2 "
         "--apply-chat-template --system-instruction \"Answer with the city only.\" --output capitals-chat.json", ""),
    ],
    "merge an adapter (docs/training.md, docs/parallel.md)": [
        (f"{PREPARED} runs/sft runs/lora:OUTPUT_DIR", ""),
        ("posttune merge --adapter OUTPUT_DIR/adapter -o OUTPUT_DIR/merged", ""),
    ],
    "a new plugin (docs/plugins.md)": [
        ("posttune new plugin my-loss --kind method", ""),
    ],
    # the bundled examples that chain runs or models of their own: shortened here in the default run, so a
    # pre-launch check that refuses one (roles' tokenizers, a reward model's path) is seen at once; their full
    # learning runs are the `example` tests (tox -e examples)
    "RLHF (docs/ppo.md)": [
        ("python -m posttune_grpo.example prepare --steps 150 --out outputs/ppo-tiny-start/model", "--steps 2"),
        ("posttune train rm-tiny-reverse", SHORT),
        ("posttune train ppo-tiny-reverse", SHORT),
    ],
    "the tiny mixture-of-experts example (docs/moe.md)": [
        ("posttune train mixtral-tiny-reverse", SHORT),
    ],
    "the mixture-of-experts recipes (docs/moe.md)": [
        # Mixtral 8x7B from the hub on a GPU: validated as documented, not trained
        ("posttune train mixtral-8x7b-qlora", "VALIDATE"),
    ],
    "the qwen3 GSM8K recipe's overrides (docs/grpo.md)": [
        # a 0.6B hub model on GPUs: validated with the documented overrides, not trained
        ("posttune train qwen3-0.6b-grpo-gsm8k method.micro_batch_size=8 train.grad_accum_steps=8 "
         "'memory=[chunked_cross_entropy, activation_checkpointing]'", "VALIDATE"),
    ],
}
SLOW = {"GRPO (README, docs/grpo.md)", "KD (README, docs/kd.md)", "eval with a local task (docs/eval.md)"}
#: scenarios that train a method or model of their own (a minute or two each on 2 cores): `tox -e extended` runs
#: them; the default run keeps the training quick start and the README demo, and every scenario's commands are
#: still checked to be here (test_every_documented_command_is_checked)
EXTENDED = {"DPO (README, docs/dpo.md)", "GRPO (README, docs/grpo.md)", "KD (README, docs/kd.md)",
            "quantize (docs/quantize.md)", "eval with a local task (docs/eval.md)"}

#: documented commands not run here, and why (each still has to be in the docs: no stale entries)
NOT_RUN: dict[str, str] = {
    "posttune train my.yaml --nproc-per-node 8 --standalone": "8 processes; tests/distributed runs the launcher",
    "posttune train my.yaml train.lr=1e-4 --nproc-per-node 8": "8 processes; tests/distributed runs the launcher",
    "posttune train my.yaml --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 "
    "--rdzv-id my-run": "two machines",
    "python -m posttune_grpo.example make-data": "rewrites the package's bundled files in place",
    "posttune train qwen3-30b-a3b-lora --nproc-per-node 8 --standalone":
        "8 GPUs and a hub checkpoint; tests/models/test_qwen_configs.py validates the recipe and "
        "tests/distributed/test_expert_parallel.py runs fsdp2 + ep under the launcher",
    "posttune eval --model runs/sft/model --tasks arc_easy,hellaswag --limit 200 --output eval.json":
        "hub datasets; tests/lmeval compares local tasks with lm-eval's HF model",
    "posttune eval --adapter runs/lora/adapter --tasks arc_easy --num-fewshot 5 --batch-size 16":
        "a hub dataset; tests/lmeval runs --adapter on local tasks",
}
#: documented commands another test runs: command -> (test file, a string that file must hold)
ELSEWHERE: dict[str, tuple[str, str]] = {
    "posttune train rank.yaml": ("plugins/template/tests/test_template.py", "toy_rank"),
    "posttune validate rank.yaml method.scale=-1": ("plugins/template/tests/test_template.py", "method.scale=-1"),
    "posttune generate --chat-template-kwargs '{\"enable_thinking\": false}'":
        ("tests/e2e/test_chat_template_kwargs.py", '"--chat-template-kwargs", \'{"enable_thinking": false}\''),
}

#: quoted error line (its start) -> the command that prints it, run in a scratch directory
#: holding data/train.jsonl (a bad byte on line 12) and data/train.json (one object)
ERRORS: dict[str, str] = {
    "posttune: error: config: train.lr: expected a number, got 'f":
        "posttune validate llama-demo-reverse train.lr=fast",
    "posttune: error: config: train.lrr: unknown key (did you mean ":
        "posttune validate llama-demo-reverse train.lrr=1",
    "posttune: error: config: train.learning_rate: unknown key; learni": "posttune validate llama-demo-reverse "
                                                                         "train.learning_rate=1",
    "posttune: error: config: method: no method 'sftt' is installed":
        "posttune validate llama-demo-reverse method=sftt",
    "posttune: error: config: train.max_grad_norm: expected a number":
        "posttune validate llama-demo-reverse train.max_grad_norm=-1",
    "posttune: error: config: checkpoint.keep_last: expected a posit":
        "posttune validate llama-demo-reverse checkpoint.keep_last=0",
    "posttune: error: config: models.teacher: method 'dpo' uses no te":
        "posttune validate dpo-tiny-reverse teacher.path=somewhere",
    "posttune: error: config: models.reference: set `path` (a checkpo":
        "posttune validate dpo-tiny-reverse models.reference.dtype=fp32",
    "posttune: error: config: data.train.path: data/train.jsonl: lin":
        f"posttune train llama-demo-reverse data.train.path=data/train.jsonl data.train.format=alpaca {SHORT}",
    "posttune: error: config: data.train.path: data/train.json: hold":
        f"posttune train llama-demo-reverse data.train.path=data/train.json data.train.format=alpaca {SHORT}",
    "posttune: error: config: train.optimizer: torch.optim.AdamW: go":
        "posttune validate llama-demo-reverse train.optimizer._component_=torch.optim.AdamW "
        "'train.optimizer.betass=[0.9,0.99]'",
    "posttune: error: config: train.optimizer._component_: refusing ":
        "posttune validate llama-demo-reverse train.optimizer._component_=os.system",
    "posttune: error: config: train.optimizer.momentum._component_: refusing ":
        "posttune validate llama-demo-reverse 'train.optimizer={_component_: torch.optim.SGD, momentum: "
        "{_component_: torch.utils.collect_env.run, command: \"id > PWNED\"}}'",
    "posttune: error: checkpoint: 'Qwen/Qwen2.5-0.5B' is a Hugging F":
        "HF_HUB_OFFLINE=0 HF_ENDPOINT=http://127.0.0.1:9 posttune train llama-demo-reverse "
        "model.path=Qwen/Qwen2.5-0.5B",
}
ERRORS_ELSEWHERE: dict[str, tuple[str, str]] = {
    "posttune: error: reward 'math_answer' (posttune-grpo 0.1.0) retu":
        ("tests/methods/test_grpo_training.py", "returned None (cannot score) for completion 0"),
    "posttune: error: reward 'math_answer' (posttune-grpo 0.1.0) took":
        ("tests/methods/test_grpo_reward_limits.py", "took longer than timeout_s (0.5 s) for "),
    "posttune: error: config: models.teacher: the teacher's vocabular":
        ("tests/methods/test_kd_training.py", "the teacher's vocabulary has 400 tokens and the student's 384"),
    "posttune: error: config: logging[1]: no metric logger 'wandbb' is installed (installed: tensorboard) ":
        ("tests/trackers/test_tensorboard.py", "no metric logger 'wandbb' is installed (installed: "),
    "posttune: error: logging: tracker 'wandb' (posttune-wandb 0.1.0) failed to start: ":
        ("tests/trackers/test_wandb.py", "failed to start: UsageError: No API key "),
}
#: lines of a quoted output that come from a plugin the same page writes as an example, not installed here
EXAMPLE_PLUGIN_LINES = ("posttune-keyword 0.1.0",)

PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b|\[|\.\.\.")
INSTALL = ("pip install", "python3 -m venv", "python -m venv", ". .venv/bin/activate", "tox")


def _synopsis(text: str) -> bool:
    words = text.split()
    # `posttune train --nproc-per-node 2`: an option shown without the config it goes with
    no_config = (len(words) > 2 and words[2].startswith("--")
                 and (words[:2] in (["posttune", "train"], ["posttune", "plan"])
                      or len(words) == 3))  # `posttune generate --adapter`
    bare = len(words) <= (3 if words[1:2] in (["config"], ["new"]) else 2)  # `posttune plan`, `posttune new plugin`
    return bool(PLACEHOLDER.search(text)) or no_config or (words[0] == "posttune" and bare
                                                           and text not in ("posttune ls", "posttune plugins"))


def _kind(text: str) -> str:
    if text.startswith(INSTALL):
        return "install"
    return "synopsis" if _synopsis(text) else "run"


def _documented() -> list[Shown]:
    shown = [Shown(re.split(r"\s{2,}", c.text)[0], c.file, c.line) for c in block_commands()]
    return shown + [s for s in span_commands() if s.text != "posttune"]


RUN_HERE = {command for steps in SCENARIOS.values() for command, _ in steps
            if not command.startswith((SETUP, PREPARED))}


def test_every_documented_command_is_checked():
    unchecked = sorted({f"{s.where}: {s.text}" for s in _documented() if _kind(s.text) == "run"
                        and s.text not in RUN_HERE | set(NOT_RUN) | set(ELSEWHERE)})
    assert not unchecked, ("documented commands no test runs (add them to SCENARIOS or NOT_RUN):\n"
                           + "\n".join(unchecked))
    keys = set(ERRORS) | set(ERRORS_ELSEWHERE)
    unproduced = [f"{e.where}: {e.text}" for e in quoted_errors() if not any(e.text.startswith(k) for k in keys)]
    assert not unproduced, "quoted errors no command in ERRORS produces:\n" + "\n".join(unproduced)


def test_no_stale_entries():
    documented = {s.text for s in _documented()}
    stale = (RUN_HERE | set(NOT_RUN) | set(ELSEWHERE)) - documented
    stale |= {k for k in set(ERRORS) | set(ERRORS_ELSEWHERE) if not any(e.text.startswith(k) for e in quoted_errors())}
    assert not stale, f"no longer in the docs: {sorted(stale)}"
    for command, (path, marker) in {**ELSEWHERE, **ERRORS_ELSEWHERE}.items():
        assert marker in (ROOT / path).read_text(encoding="utf-8"), f"{path} no longer checks {command!r}"


# ---- synopses and install lines ----------------------------------------------------------------

@functools.cache
def _help(subcommand: str) -> str:
    args = [str(BIN / "posttune"), *subcommand.split(), "--help"]
    result = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 0, f"posttune {subcommand} --help: {result.stderr}"
    return result.stdout


SYNOPSES = sorted({s.text: s for s in _documented() if _kind(s.text) == "synopsis"}.values(), key=lambda s: s.text)


@pytest.mark.parametrize("shown", SYNOPSES, ids=lambda s: s.text[:60])
def test_a_synopsis_names_a_real_subcommand_and_real_options(shown):
    words = shown.text.split()
    if words[0] != "posttune" or len(words) == 1 or words[1].startswith("--") and words[1] != "--help":
        flags = [w for w in words if w.startswith("--")]
        top = _help("")
        assert all(f.strip("[]") in top for f in flags), f"{shown.where}: {flags} not all in `posttune --help`"
        return
    subcommands = words[1].split("/")  # `posttune train/plan/validate`
    if words[1] == "config" and len(words) > 2:
        subcommands = [f"config {words[2]}"]
    if words[1] == "NAME":
        subcommands = ["train"]
    for subcommand in subcommands:
        text = _help(subcommand)
        for flag in re.findall(r"--[a-z][a-z-]*", shown.text):
            assert flag in text, f"{shown.where}: `posttune {subcommand}` has no {flag}"
        if subcommand == "ls":
            for kind in re.findall(r"\[([a-z|]+)\]", shown.text)[:1]:
                for name in kind.split("|"):
                    assert name in text, f"{shown.where}: `posttune ls` does not know {name!r}"


def _distributions() -> dict[str, Path]:
    found = {}
    for pyproject in ROOT.glob("*/**/pyproject.toml"):
        if ".venv" in pyproject.parts or ".tox" in pyproject.parts:
            continue
        found[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return found


INSTALLS = sorted({s.text: s for s in _documented() if s.text.startswith("pip install")}.values(), key=lambda s: s.text)


@pytest.mark.parametrize("shown", INSTALLS, ids=lambda s: s.text[:60])
def test_an_install_line_names_real_distributions_and_extras(shown):
    distributions = _distributions()
    words = shlex.split(shown.text)[2:]
    for word in words:
        if word.startswith("-") or word == "constraints.txt" or word in {"tox"}:
            continue
        name, _, extras = word.partition("[")
        if name.startswith("./"):
            path = ROOT / name
            assert (path / "pyproject.toml").is_file(), f"{shown.where}: {name} is not a distribution"
            project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        else:
            assert name in distributions, f"{shown.where}: no distribution {name!r} in this repository"
            project = tomllib.loads((distributions[name] / "pyproject.toml").read_text())["project"]
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert extra in project.get("optional-dependencies", {}), f"{shown.where}: {name} has no extra [{extra}]"
    if "./" in shown.text:
        assert "-c constraints.txt" in shown.text, (f"{shown.where}: a source install must pin torch with "
                                                    "-c constraints.txt")


# ---- scenarios ---------------------------------------------------------------------------------

def _with_extra(command: str, extra: str) -> str:
    if not extra:
        return command
    words = shlex.split(command)
    if words[:2] in (["posttune", "train"], ["posttune", "plan"], ["posttune", "validate"]):
        return shlex.join(words[:3] + shlex.split(extra) + words[3:])
    return f"{command} {extra}"


def _run(command: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, env=ENV, timeout=900)
    if check:
        assert result.returncode == 0, (f"`{command}` -> {result.returncode}\n{result.stdout[-2000:]}\n"
                                        f"{result.stderr[-3000:]}")
    return result


def _pattern(line: str) -> re.Pattern:
    line = " ".join(line.split())
    return re.compile(".*".join(re.escape(part) for part in line.split("...")) + r"\Z")


def assert_output_matches(quoted: tuple[str, ...], printed: str, where: str) -> None:
    """``quoted`` (a `$ command` block's output) against ``printed``: groups between `...` lines are runs
    of consecutive lines, in order; `...` inside a line matches anything; spaces are normalised."""
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    groups: list[list[str]] = [[]]
    for line in quoted:
        if line.strip() == "...":
            groups.append([])
        elif not any(marker in line for marker in EXAMPLE_PLUGIN_LINES):
            groups[-1].append(line)
    start = 0
    for group in filter(None, groups):
        patterns = [_pattern(line) for line in group]
        for i in range(start, len(lines) - len(patterns) + 1):
            if all(p.match(lines[i + k]) for k, p in enumerate(patterns)):
                start = i + len(patterns)
                break
        else:
            raise AssertionError(f"{where}: the docs quote\n  " + "\n  ".join(group) + "\nbut the command printed\n  "
                                 + "\n  ".join(lines[start:]))


TRANSCRIPTS = {t.text: [] for t in transcripts()}
for _t in transcripts():
    TRANSCRIPTS[_t.text].append(_t)


def test_every_quoted_output_belongs_to_a_scenario():
    assert set(TRANSCRIPTS) <= RUN_HERE, f"quoted outputs of commands no scenario runs: {set(TRANSCRIPTS) - RUN_HERE}"


@pytest.fixture(scope="module")
def prepared_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    for command in PREPARE:
        _run(command, root)
    return root


def _copy_prepared(spec: str, root: Path, cwd: Path) -> None:
    """The runs ``spec`` names, copied from ``root`` into ``cwd`` as if trained there: an adapter names its
    base model by absolute path, so it names the copy's."""
    for item in spec.split():
        source, _, target = item.partition(":")
        shutil.copytree(root / source, cwd / (target or source), symlinks=True)
    for config in cwd.rglob("adapter_config.json"):
        config.write_text(config.read_text().replace(str(root.resolve()), str(cwd.resolve())))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[mark for mark, names in ((pytest.mark.slow, SLOW),
                                                                                  (pytest.mark.extended, EXTENDED))
                                                         if n in names]) for n in SCENARIOS])
def test_documented_commands_run(name, tmp_path, request):
    for command, extra in SCENARIOS[name]:
        if command.startswith(PREPARED):
            _copy_prepared(command.removeprefix(PREPARED), request.getfixturevalue("prepared_runs"), tmp_path)
            continue
        if extra == "VALIDATE":
            words = shlex.split(command)
            result = _run(shlex.join(["posttune", "validate", *words[2:]]), tmp_path)
            assert "valid" in result.stdout
            continue
        result = _run(_with_extra(command, extra), tmp_path)
        for shown in TRANSCRIPTS.get(command, []):
            assert_output_matches(shown.output, result.stdout, shown.where)
        _check_outcome(command, result, tmp_path)


def _check_outcome(command: str, result: subprocess.CompletedProcess, cwd: Path) -> None:
    """What each run must leave or print beyond exit status 0 (the docs' claims about it)."""
    if command == "posttune ls --json methods":
        assert {"sft", "dpo"} <= set(json.loads(result.stdout)["methods"])
    elif command.startswith("posttune cp "):
        assert (cwd / command.split()[-1]).is_file()
    elif command == "posttune train my.yaml train.max_steps=6 checkpoint.save_every=2 checkpoint.resume=latest":
        steps = [json.loads(line)["step"] for line in (cwd / "outputs/llama3.2-1b-lora/metrics.jsonl").open()]
        assert steps[-2:] == [5, 6], steps  # the extended run logs steps 5 and 6
    elif command in ("posttune train llama-demo-reverse", "posttune train rm-tiny-reverse",
                     "posttune train mixtral-tiny-reverse"):
        assert (cwd / "outputs" / command.split()[-1] / "model/config.json").is_file()
    elif command == "posttune train ppo-tiny-reverse":  # the policy and the value model, each an HF checkpoint
        assert all((cwd / "outputs/ppo-tiny-reverse" / name / "config.json").is_file() for name in ("model", "value"))
    elif command.startswith("posttune generate"):
        assert result.stdout.strip(), "generate printed nothing"  # the trained answer: tests/e2e/test_demo.py
    elif command.startswith("posttune quantize"):
        assert "quantization_config" in json.loads((cwd / command.split()[-1] / "config.json").read_text())
    elif command.startswith("posttune eval"):
        results = json.loads((cwd / shlex.split(command)[-1]).read_text())  # --output comes last
        assert "acc" in json.dumps(results["results"])
        assert bool(results["chat_template"]) == ("--apply-chat-template" in command)  # the template's source
    elif command.startswith("posttune new plugin"):
        assert (cwd / "posttune-my-loss" / "pyproject.toml").is_file()
    elif command.startswith("posttune plot"):
        assert (cwd / command.split()[-1] / "loss.png").is_file()


@pytest.mark.parametrize("start", sorted(ERRORS))
def test_a_quoted_error_is_what_the_command_prints(start, tmp_path):
    (tmp_path / "data").mkdir()
    good = json.dumps({"instruction": "a", "input": "", "output": "b"})
    (tmp_path / "data/train.jsonl").write_bytes(((good + "\n") * 11).encode() + b'{"instruction": "\xff"}\n')
    (tmp_path / "data/train.json").write_text(json.dumps({"data": [json.loads(good)]}))
    result = _run(ERRORS[start], tmp_path, check=False)
    assert result.returncode == 2, f"{ERRORS[start]} -> {result.returncode}: {result.stderr[-1000:]}"
    printed = result.stderr.strip().splitlines()[-1].replace("http://127.0.0.1:9", "https://huggingface.co")
    quoted = next(e for e in quoted_errors() if e.text.startswith(start))
    assert _pattern(quoted.text).match(" ".join(printed.split())), (f"{quoted.where}: quoted\n{quoted.text}\n"
                                                                    f"printed\n{printed}")
