"""The README demo: `posttune train llama-demo-reverse`, shortened, and (slow) in full."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import posttune


def posttune_cmd(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttune.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_shortened_demo_leaves_a_checkpoint_transformers_and_generate_load(tmp_path):
    out = tmp_path / "demo"
    run = posttune_cmd("train", "llama-demo-reverse", f"checkpoint.output_dir={out}", "train.max_steps=20",
                       "train.eval_every=10", "train.warmup_steps=2")
    assert run.returncode == 0, run.stderr
    assert "prompt: Reverse: PLUGIN" in run.stdout and "after:" in run.stdout
    assert (out / "loss.png").is_file() and (out / "metrics.jsonl").is_file()
    ours = posttune.load_model(out / "model")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    ids = torch.tensor([[1, 5, 9, 40, 77]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-4, rtol=0)
    generated = posttune_cmd("generate", "--model", str(out / "model"), "--prompt", "Reverse: ABC", "--chat",
                             "--max-new-tokens", "6")
    assert generated.returncode == 0, generated.stderr
    # generate's start-up (benchmarks/cli_start.py times it): nothing it does not use is imported
    heavy = ("torch._dynamo", "sympy", "transformers", "torchao", "datasets", "matplotlib")
    probe = subprocess.run([sys.executable, "-c", "import sys; from posttune.cli.main import main; main(sys.argv[1:]); "
                            f"print(sorted(m for m in {heavy!r} if m in sys.modules))", "generate", "--model",
                            str(out / "model"), "--prompt", "Reverse: ABC", "--chat", "--max-new-tokens", "2"],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().splitlines()[-1] == "[]", f"generate imported {probe.stdout.strip().splitlines()[-1]}"


#: what the README promises of the demo: a final validation loss below this (every seed we ran,
#: 0-4 with 1 and 2 threads, ends near 0.0004: benchmarks/demo_seeds.py), and exact answers
MAX_VAL_LOSS = 0.01
MIN_EXACT_MATCH = 0.95


def readme_generate_example() -> tuple[list[str], str]:
    """The README's `posttune generate` command for the demo model, and the answer it promises."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    match = re.search(r"`(posttune generate --model outputs/llama-demo-reverse/model [^`]+)` prints `([^`]+)`", readme)
    assert match, "README.md has no `posttune generate ...` prints `...` example for the demo"
    return shlex.split(match.group(1))[1:], match.group(2)


@pytest.mark.slow
def test_full_demo_learns_to_reverse_unseen_strings(full_demo):
    """The whole demo as the README runs it (~2 minutes on 2 cores), judged by what robustness means
    rather than one machine's trajectory: exact answers on the whole validation split, the three
    sample prompts and the README's example, and a validation loss well under the README's figure.
    The run (tests/e2e/conftest.py, ``full_demo``) trains in the background while the other end-to-end
    tests run; this test, ordered after them, waits for it."""
    process, root = full_demo()
    process.wait(timeout=1800)  # ~2 min alone; generous for a busy shared machine
    stdout, stderr = (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text()
    assert process.returncode == 0, stderr
    out = root / "demo"
    answers = {}
    for block in stdout.split("prompt: ")[1:]:
        prompt, _, rest = block.partition("\n")
        answers[prompt] = rest.split("after:", 1)[1].strip().splitlines()[0].strip("'")
    assert answers == {"Reverse: PLUGIN": "NIGULP", "Reverse: TORCH": "HCROT", "Reverse: HELLO": "OLLEH"}
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["val_loss"] < MAX_VAL_LOSS
    from posttune_llama.demo.check import score

    scored = score(out / "model")
    assert scored["exact_match"] >= MIN_EXACT_MATCH, scored
    assert scored["samples_right"], scored["samples"]
    argv, promised = readme_generate_example()
    argv[argv.index("outputs/llama-demo-reverse/model")] = str(out / "model")
    generated = posttune_cmd(*argv)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip() == promised
