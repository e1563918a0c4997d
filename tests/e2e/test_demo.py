"""The README demo: `posttune train llama-demo-reverse`, shortened, and (slow) in full."""

from __future__ import annotations

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


@pytest.mark.slow
def test_full_demo_learns_to_reverse_unseen_strings(tmp_path):
    """The whole demo as the README runs it (~2 minutes on 2 cores): the answers after training are right."""
    run = posttune_cmd("train", "llama-demo-reverse", f"checkpoint.output_dir={tmp_path / 'demo'}",
                       timeout=1800)  # ~2 min alone; generous for a busy shared machine
    assert run.returncode == 0, run.stderr
    answers = {}
    for block in run.stdout.split("prompt: ")[1:]:
        prompt, _, rest = block.partition("\n")
        answers[prompt] = rest.split("after:", 1)[1].strip().splitlines()[0].strip("'")
    assert answers == {"Reverse: PLUGIN": "NIGULP", "Reverse: TORCH": "HCROT", "Reverse: HELLO": "OLLEH"}
    assert Path(tmp_path / "demo" / "model" / "config.json").is_file()
