"""`posttune train` restarts itself once on jemalloc when asked or found (posttune/allocator.py), and
``POSTTUNE_ALLOCATOR`` is checked in one line."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttune import allocator
from posttune.cli import main as cli_main
from posttune.errors import PosttuneError


def jemalloc_library() -> str | None:
    """A jemalloc the test can preload: the system's, or the one Ray ships for its own processes."""
    spec = importlib.util.find_spec("ray")
    bundled = Path(spec.origin).parent / "core" / "libjemalloc.so" if spec and spec.origin else None
    return ctypes.util.find_library("jemalloc") or (str(bundled) if bundled and bundled.is_file() else None)


def test_the_choice_is_read_from_the_environment(monkeypatch, tmp_path):
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    for value, expected in [("system", None), ("auto", None), ("", None), (str(library), str(library.resolve()))]:
        monkeypatch.setenv(allocator.ENV, value)
        assert allocator.chosen_library() == expected
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    with pytest.raises(PosttuneError, match="^POSTTUNE_ALLOCATOR=jemalloc: the dynamic linker finds no libjemalloc"):
        allocator.chosen_library()
    monkeypatch.setenv(allocator.ENV, str(tmp_path / "missing.so"))
    with pytest.raises(PosttuneError, match="neither auto, jemalloc, system nor an existing library file"):
        allocator.chosen_library()
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: "libjemalloc.so.2")
    monkeypatch.setenv(allocator.ENV, "auto")
    assert allocator.chosen_library() == "libjemalloc.so.2"


def test_only_the_console_entry_restarts_and_a_bad_choice_is_one_line(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(allocator, "preload", calls.append)
    assert cli_main.main(["train", "no-such-config"]) == cli_main.USER_ERROR  # in-process: never replaced
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["posttune", "train", "no-such-config"])
    assert cli_main.main() == cli_main.USER_ERROR
    assert calls == [["-m", "posttune.cli.main", "train", "no-such-config"]]
    monkeypatch.undo()
    monkeypatch.setenv(allocator.ENV, "/no/such/libjemalloc.so")
    monkeypatch.setattr(sys, "argv", ["posttune", "train", "no-such-config"])
    capsys.readouterr()
    assert cli_main.main() == cli_main.USER_ERROR
    assert capsys.readouterr().err == ("posttune: error: POSTTUNE_ALLOCATOR=/no/such/libjemalloc.so: neither auto, "
                                       "jemalloc, system nor an existing library file\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is the Linux dynamic linker's")
def test_a_run_restarts_on_jemalloc_once_and_trains(make_config, tmp_path):  # installed plugins: a child process
    library = jemalloc_library()
    if library is None:
        pytest.skip("no jemalloc on this machine (neither the system's nor Ray's)")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config(tmp_path, train={"max_steps": 2})))
    env = {**os.environ, allocator.ENV: library}
    env.pop(allocator.PRELOADED, None)
    run = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", str(path)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "world size 1, allocator jemalloc" in run.stdout
    steps = [line for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 2 and any((tmp_path / "out" / "model").glob("*.safetensors"))
