"""Distributed runs for tests: `posttune train` under torchrun (gloo, CPU), each run once per session.

Every run trains the same tiny Llama SFT job; a parallel run and the single-process run that
sees the same global batch must log the same per-step losses and save the same model.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

TOKENIZER = "package:posttune_llama/demo/tokenizer"
ROWS = 32
STEPS = 4
TIMEOUT = 300  # seconds per launch; a hang fails the test instead of the suite


def rows(count: int, seed: int = 0, *, kind: str = "sft") -> list[dict]:
    """Reverse-a-string rows: SFT chats, preference pairs (chosen the reversal, rejected a copy), or
    prompts with their answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 9)))
        if kind == "preference":
            out.append({"prompt": f"Reverse: {word}", "chosen": word[::-1], "rejected": word})
        elif kind == "unpaired":  # KTO's feedback: the reversal desirable, the copy not, in turn
            answer, label = (word[::-1], True) if len(out) % 2 == 0 else (word, False)
            out.append({"prompt": f"Reverse: {word}", "completion": answer, "label": label})
        elif kind == "prompt":
            out.append({"prompt": f"Reverse: {word}", "answer": word[::-1]})
        else:
            out.append({"messages": [{"role": "user", "content": f"Reverse: {word}"},
                                     {"role": "assistant", "content": word[::-1]}]})
    return out


def write_config(directory: Path, *, batch_size: int, parallel: dict | None = None, adapter: dict | None = None,
                 checkpoint: dict | None = None, steps: int = STEPS, method: dict | None = None,
                 teacher: dict | None = None, model: dict | None = None, models: dict | None = None) -> Path:
    """A tiny Llama run: SFT by default; a ``method`` named dpo trains on preference pairs, grpo on prompts
    (kd on the SFT chats, from the ``teacher`` section)."""
    directory.mkdir(parents=True, exist_ok=True)
    method = method or {"name": "sft"}
    kind = {"dpo": "preference", "kto": "unpaired", "grpo": "prompt", "ppo": "prompt"}.get(method["name"], "sft")
    data = directory / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows(ROWS, kind=kind)))
    config = {
        "model": model or {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": TOKENIZER},
        "method": method,
        "data": {"train": {"path": str(data), "format": {"sft": "chat"}.get(kind, kind)}, "max_seq_len": 48},
        "train": {"max_steps": steps, "batch_size": batch_size, "lr": 1e-3, "seed": 0},
        "checkpoint": {"output_dir": str(directory / "out"), **(checkpoint or {})},
        "parallel": parallel or {},
    }
    if adapter is not None:
        config["adapter"] = adapter
    if teacher is not None:
        config["teacher"] = teacher
    if models is not None:
        config["models"] = models
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1"}


def train(config: Path, *overrides: str, nproc: int | None = None) -> subprocess.CompletedProcess:
    """`posttune train CONFIG OVERRIDES [--nproc-per-node N --standalone]` in a subprocess."""
    launch = ["--nproc-per-node", str(nproc), "--standalone"] if nproc else []
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), *overrides, *launch]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Callable[..., Path]:
    """``runs(name, batch_size=, parallel=, nproc=, ...)`` -> the run's output dir, trained once per session."""
    root = tmp_path_factory.mktemp("distributed")
    done: dict[str, Path] = {}
    failed: dict[str, str] = {}

    def run(name: str, *, nproc: int | None = None, overrides: tuple[str, ...] = (), **config) -> Path:
        if name in failed:  # a run is tried once: a retry would meet the failed run's results
            pytest.fail(f"run {name!r} failed earlier in this session:\n{failed[name]}")
        if name not in done:
            path = write_config(root / name, **config)
            try:
                train(path, *overrides, nproc=nproc)
            except AssertionError as exc:
                failed[name] = str(exc)[-4000:]
                raise
            done[name] = root / name / "out"
        return done[name]

    return run
