"""Hub ids without a network fail in seconds with one line saying how to pass a local directory.

These run `posttune` for real, in a fresh process with ``HF_HUB_OFFLINE`` unset: against the
real hub address (this test machine has no network; skipped where the hub answers) and against
a local server that accepts connections and never answers, the case that makes clients retry.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from run_support import TOKENIZER

from posttune import hub

LIMIT_S = 15
MODEL = {"model": {"path": "posttune-tests/no-such-model"}, "method": "sft",
         "data": {"train": {"path": "d.jsonl", "format": "chat"}}}


def posttune(*argv: str, cwd: Path, endpoint: str | None = None, offline: bool = False):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")}
    env.update({"OMP_NUM_THREADS": "1", "HF_HOME": str(cwd / "hf-home")})
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "posttune.cli.main", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.fixture(scope="module")
def silent_endpoint():
    """``http://127.0.0.1:PORT`` of a server that accepts every connection and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for connection in held:
        connection.close()


def real_hub_unreachable() -> bool:
    saved = dict(hub._probed)
    try:
        return not hub._answers(hub.DEFAULT_ENDPOINT, hub.PROBE_TIMEOUT)
    finally:
        hub._probed.clear()
        hub._probed.update(saved)


def one_fast_line(done, seconds) -> str:
    assert done.returncode == 2, done.stderr
    assert seconds < LIMIT_S, f"took {seconds:.1f} s"
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr and "Retrying" not in done.stderr, \
        done.stderr
    return done.stderr


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.skipif(not real_hub_unreachable(), reason="the hub answers from here")
def test_a_hub_model_fails_fast_without_a_network(tmp_path):
    done, seconds = posttune("validate", write(tmp_path, MODEL), cwd=tmp_path)
    line = one_fast_line(done, seconds)
    assert line.startswith("posttune: error: checkpoint: 'posttune-tests/no-such-model' is a Hugging Face hub id, "
                           "but the hub is unreachable (no answer from https://huggingface.co within 3 s)")
    assert "pass a local checkpoint directory instead" in line


def test_a_hub_model_fails_fast_when_the_hub_never_answers(tmp_path, silent_endpoint):
    done, seconds = posttune("plan", write(tmp_path, MODEL), cwd=tmp_path, endpoint=silent_endpoint)
    assert f"the hub is unreachable (no answer from {silent_endpoint} within 3 s)" in one_fast_line(done, seconds)


def test_a_hub_tokenizer_fails_fast(tmp_path, silent_endpoint, run_folder):
    config = {"model": {"family": "llama", "size": "tiny"}, "tokenizer": {"path": "posttune-tests/no-such-tok"},
              "method": "sft", "data": {"train": {"path": str(run_folder / "d.jsonl")}}, "train": {"device": "cpu"},
              "checkpoint": {"output_dir": str(tmp_path / "out")}}
    done, seconds = posttune("train", write(tmp_path, config), cwd=tmp_path, endpoint=silent_endpoint)
    line = one_fast_line(done, seconds)
    assert line.startswith("posttune: error: tokenizer: 'posttune-tests/no-such-tok' is a Hugging Face hub id, but "
                           "the hub is unreachable")
    assert "pass a local checkpoint folder instead" in line


def test_a_hub_dataset_fails_fast(tmp_path, silent_endpoint):
    config = {"model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
              "tokenizer": {"path": TOKENIZER}, "method": "sft",
              "data": {"train": {"path": "posttune-tests/no-such-data", "format": "chat"}},
              "train": {"device": "cpu", "max_steps": 1}, "checkpoint": {"output_dir": str(tmp_path / "out")}}
    done, seconds = posttune("train", write(tmp_path, config), cwd=tmp_path, endpoint=silent_endpoint)
    line = one_fast_line(done, seconds)
    assert line.startswith("posttune: error: config: data.train.path: 'posttune-tests/no-such-data' is a Hugging "
                           "Face hub id, but the hub is unreachable")
    assert "pass a local file or folder instead, or set HF_HUB_OFFLINE=1" in line


def test_download_fails_fast(tmp_path, silent_endpoint):
    done, seconds = posttune("download", "posttune-tests/no-such-model", cwd=tmp_path, endpoint=silent_endpoint)
    assert "download of posttune-tests/no-such-model failed: the Hugging Face hub is unreachable" in \
        one_fast_line(done, seconds)


def test_hf_hub_offline_skips_the_probe_and_stays_one_line(tmp_path, silent_endpoint):
    done, seconds = posttune("validate", write(tmp_path, MODEL), cwd=tmp_path, endpoint=silent_endpoint,
                             offline=True)
    line = one_fast_line(done, seconds)
    assert line.startswith("posttune: error: posttune-tests/no-such-model: cannot fetch config.json from the hub: ")
    assert seconds < hub.PROBE_TIMEOUT + 5


@pytest.mark.parametrize("section, value, message", [
    ("model", "models/llama", "config: model.path: models/llama: no such checkpoint directory"),
    ("model", "./llama", "config: model.path: ./llama: no such checkpoint directory"),
    ("model", "models/model.safetensors", "config: model.path: models/model.safetensors: is a file; give the "
                                          "checkpoint folder that holds config.json and the weights"),
    ("data", "models/train", "config: data.train.path: no such file or directory 'models/train' (relative to the "
                             "working directory {cwd})"),
])
def test_a_missing_local_path_is_not_a_hub_problem(tmp_path, section, value, message, silent_endpoint):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "model.safetensors").write_bytes(b"")
    config = {"model": {"path": value} if section == "model" else {"family": "llama", "size": "tiny",
                                                                   "build_overrides": {"vocab_size": 384}},
              "tokenizer": {"path": TOKENIZER}, "method": "sft",
              "data": {"train": {"path": value if section == "data" else "d.jsonl", "format": "chat"}},
              "train": {"device": "cpu", "max_steps": 1}, "checkpoint": {"output_dir": str(tmp_path / "out")}}
    done, seconds = posttune("train", write(tmp_path, config), cwd=tmp_path, endpoint=silent_endpoint)
    assert one_fast_line(done, seconds) == f"posttune: error: {message.format(cwd=tmp_path)}\n"
