"""The output directory belongs to one run: a lock while it trains, no silent reuse of another
run's results, pruning only within the run's own lineage, and every problem `posttune validate`
could see refused there already, in one line."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml
from posttune.errors import ConfigError
from posttune.training import output_dir, run_lock, state


def one_line(result, status: int = 2) -> str:
    assert result.exit_code == status, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip()


def test_a_second_run_on_a_locked_output_dir_is_refused_naming_the_holder(llama_sft, posttune_cli, write_config,
                                                                          tmp_path):
    path = write_config(train={"max_steps": 1})
    fd = run_lock.acquire(tmp_path / "out")  # as a live run on this directory holds it
    try:
        for command in ("validate", "train"):
            line = one_line(posttune_cli(command, str(path)), status=75)  # worth a retry: the holder may finish
            assert line == (f"posttune: error: config: checkpoint.output_dir: {tmp_path / 'out'} is in use by "
                            f"another run (host {socket.gethostname()}, pid {os.getpid()}); wait for it to finish "
                            "or choose another output_dir")
    finally:
        run_lock.release(fd)
    # the holder is gone: its lock file stays, and the next run simply takes it over
    assert (tmp_path / "out" / run_lock.LOCK_FILE).is_file()
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr


def test_a_new_run_refuses_another_runs_results_unless_resumed_or_overwritten(llama_sft, posttune_cli,
                                                                               write_config, tmp_path):
    path = write_config(train={"max_steps": 4}, checkpoint={"save_every": 2, "keep_last": 5})
    assert posttune_cli("train", str(path)).exit_code == 0
    out = tmp_path / "out"
    first_run = json.loads((out / "run.json").read_text())["run_id"]
    for command in ("validate", "train"):
        line = one_line(posttune_cli(command, str(path)))
        assert line == (f"posttune: error: config: checkpoint.output_dir: {out} holds another run's results "
                        "(checkpoints/, model/, metrics.jsonl); set checkpoint.resume=latest to continue that run, "
                        "checkpoint.overwrite=true to start afresh, or choose another output_dir")
    model = (out / "model" / "model.safetensors").read_bytes()
    result = posttune_cli("train", str(path), "checkpoint.overwrite=true", "train.max_steps=2", "train.lr=0.01")
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "run.json").read_text())["run_id"] != first_run
    # the old checkpoints went; the one left is this run's final step
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    assert state.run_id_of(out / "checkpoints" / "step-00000002") != first_run
    assert (out / "model" / "model.safetensors").read_bytes() != model  # replaced by this run's model


def test_pruning_and_resume_latest_only_consider_this_runs_lineage(tmp_path):
    root = tmp_path / "out" / state.CHECKPOINTS
    for step, run_id in ((2, "mine"), (4, "mine"), (6, "other"), (8, "other"), (10, "mine")):
        directory = root / f"step-{step:08d}"
        directory.mkdir(parents=True)
        (directory / state.STATE_FILE).write_text(json.dumps({"step": step, "run_id": run_id}))
    (root / ".step-00000012.tmp-0123abcd").mkdir()  # a torn save
    output_dir.prune(root, 1, "mine")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006", "step-00000008", "step-00000010"]
    assert [p.name for p in state.lineage(root, "other")] == ["step-00000006", "step-00000008"]


def test_an_output_dir_under_a_file_is_refused_by_validate(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config()
    line = one_line(posttune_cli("validate", str(path), f"checkpoint.output_dir={path}/out"))
    assert line == f"posttune: error: config: checkpoint.output_dir: {path} is a file, not a directory"
    assert one_line(posttune_cli("train", str(path), f"checkpoint.output_dir={path}/out")) == line


def test_validate_probes_the_nearest_existing_parent_and_leaves_nothing_behind(tmp_path, monkeypatch):
    config = _config(tmp_path / "runs" / "a" / "b")
    before = sorted(tmp_path.iterdir())
    output_dir.check_output_dir(config)
    assert sorted(tmp_path.iterdir()) == before  # nothing created, no probe left

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(output_dir.tempfile, "mkstemp", refuse)  # root ignores chmod: inject the refusal
    with pytest.raises(ConfigError) as caught:
        output_dir.check_output_dir(config)
    assert str(caught.value) == f"config: checkpoint.output_dir: cannot write in {tmp_path}: Permission denied"


def test_leftovers_of_interrupted_writes_are_removed_at_start(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"max_steps": 2})
    out = tmp_path / "out"
    leftovers = [out / ".model.tmp-0123abcd", out / ".adapter.old-89abcdef",
                 out / "checkpoints" / ".step-00000004.tmp-deadbeef",
                 out / "checkpoints" / ".step-00000002.old-00c0ffee"]
    for leftover in leftovers:
        leftover.mkdir(parents=True)
        (leftover / "junk.bin").write_bytes(b"x")
    (out / "run.json").write_text(json.dumps({"run_id": "killed0run", "resumed_from": None, "started": 0}))
    keep = out / "notes"  # not ours: never touched (the directory is a killed run's: run.json marks it)
    keep.mkdir()
    result = posttune_cli("train", str(path), "checkpoint.resume=latest")
    assert result.exit_code == 0, result.stderr
    assert not any(p.exists() for p in leftovers) and keep.is_dir()


def _config(out):
    from posttune.config import validate

    raw = yaml.safe_load(yaml.safe_dump({"model": {"family": "llama", "size": "tiny"}, "method": "sft",
                                         "checkpoint": {"output_dir": str(out)}}))
    return validate(raw)


def test_the_output_dir_checks_are_torch_free():
    """`posttune validate` runs them without paying for torch."""
    import subprocess
    import sys

    code = ("import sys, posttune.training.output_dir as o; o.check_output_dir; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_two_concurrent_runs_on_one_directory(write_config, tmp_path):
    """Two real `posttune train` processes: the second refuses in one line naming the first's pid;
    the first finishes, and its metrics are its own, each step once."""
    steps = 500  # long enough that the first run outlives the second's start-up on a loaded machine
    path = write_config(train={"max_steps": steps, "device": "cpu"})
    out = tmp_path / "out"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "posttune.cli.main", "train", str(path)], env=environment,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while first.poll() is None and time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before the second could start"
    second = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", str(path)], env=environment,
                            capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first run ended while the second ran: the overlap was not tested"
    # 75 (EX_TEMPFAIL), not a user error's 2: a requeued job may meet the one it replaces still exiting
    assert second.returncode == 75 and second.stderr.count("\n") == 1, second.stderr
    assert f"is in use by another run (host {socket.gethostname()}, pid {first.pid})" in second.stderr
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    steps_logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(1, steps + 1))
