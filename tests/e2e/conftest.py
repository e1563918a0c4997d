"""Fixtures for end-to-end runs: a tiny Llama SFT config over a small dataset written per test."""

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

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft

TOKENIZER = "package:posttune_llama/demo/tokenizer"


def reversal_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 6)))
        rows.append({"messages": [{"role": "user", "content": f"Reverse: {word}"},
                                  {"role": "assistant", "content": word[::-1]}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_config(tmp_path: Path, *, rows: int = 24, **sections) -> dict:
    train = write_jsonl(tmp_path / "train.jsonl", reversal_rows(rows))
    config = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": TOKENIZER},
        "method": {"name": "sft"},
        "data": {"train": {"path": str(train), "format": "chat"}, "max_seq_len": 48},
        "train": {"epochs": 1, "batch_size": 4, "lr": 1e-3, "seed": 0},
        "checkpoint": {"output_dir": str(tmp_path / "out")},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


@pytest.fixture
def make_config() -> Callable[..., dict]:
    """``make_config(tmp_path, rows=24, **sections)`` -> a tiny SFT config mapping (data written)."""
    return tiny_config


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """``write_config(**sections)`` -> path of a tiny SFT config (sections merged over the defaults)."""

    def write(name: str = "run.yaml", **sections) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(tiny_config(tmp_path, **sections)))
        return path

    return write


@pytest.fixture
def llama_sft(register_plugin):
    """posttune-llama and posttune-sft registered in the test's isolated plugin set."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")



def _is_full_demo(item: pytest.Item) -> bool:
    return item.path.name == "test_demo.py" and item.name == "test_full_demo_learns_to_reverse_unseen_strings"


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The full demo (minutes of one process) trains in the background from the first end-to-end test on
    (``full_demo``): it is judged after the last of them, so that they run while it trains. Under
    pytest-xdist it is the longest test of all and is run first, so that the other worker takes the rest
    meanwhile rather than waiting for it at the end."""
    demo = next((item for item in items if _is_full_demo(item)), None)
    if demo is None:
        return
    if _xdist_worker(config):  # every worker orders alike: xdist hands out files in this order
        items[:] = [demo, *(item for item in items if item.path == demo.path and item is not demo),
                    *(item for item in items if item.path != demo.path)]
        return
    at = items.index(demo)
    items.remove(demo)
    here = Path(__file__).parent
    last = max((i for i, item in enumerate(items) if here in item.path.parents), default=at - 1)
    items.insert(last + 1, demo)


@pytest.fixture(scope="session", autouse=True)
def full_demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """`posttune train llama-demo-reverse` as the README runs it: a function giving (the process, its folder),
    where stdout.txt and stderr.txt are what it printed and demo/ its output_dir. The run starts with the first
    end-to-end test when tests/e2e/test_demo.py's full demo is selected, so that it trains while they run;
    under pytest-xdist every worker collects every test, so there it starts when the test asks for it (the
    other worker's tests are what overlaps it)."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start() -> tuple[subprocess.Popen, Path]:
        if not started:
            root = tmp_path_factory.mktemp("full-demo")
            with (root / "stdout.txt").open("w") as stdout, (root / "stderr.txt").open("w") as stderr:
                # with torch's own thread count, as the README's command runs (tox sets one thread per worker)
                env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
                process = subprocess.Popen([sys.executable, "-m", "posttune.cli.main", "train", "llama-demo-reverse",
                                            f"checkpoint.output_dir={root / 'demo'}"], stdout=stdout, stderr=stderr,
                                           text=True, env=env)
            started.append((process, root))
        return started[0]

    if any(_is_full_demo(item) for item in request.session.items) and not _xdist_worker(request.config):
        start()
    yield start
    for process, _ in started:
        if process.poll() is None:  # the test did not wait for it (deselected by -x, or it failed early)
            process.kill()
            process.wait()
