"""Preemption: SIGTERM finishes the step in flight, writes a checkpoint at it (even without
`save_every`) and exits with 143; `resume: latest` then logs the uninterrupted run's losses, bit
for bit (CPU fp32). A second SIGTERM exits at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml
from fault_support import error_line, train
from kill_support import losses, together

pytestmark = pytest.mark.slow

PREEMPTED = 143


def write(tmp_path, make_config, name: str, **train_section) -> tuple:
    """24 rows, batch 4: 6 steps an epoch; no periodic checkpoints."""
    config = make_config(tmp_path, train={"epochs": 2, "lr": 3e-3, "device": "cpu", **train_section})
    config["checkpoint"]["output_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / name


def saved(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("."))


def test_sigterm_saves_the_current_step_and_resume_matches_the_uninterrupted_run(tmp_path, make_config):
    straight, straight_out = write(tmp_path, make_config, "straight")
    path, out = write(tmp_path, make_config, "preempted")
    done, stopped = together(lambda: train(str(straight)), lambda: train(str(path), fault=("term", 5)))  # mid-epoch 0
    assert done.returncode == 0, done.stderr
    assert stopped.returncode == PREEMPTED
    assert error_line(stopped) == (f"posttune: preempted by SIGTERM: saved checkpoint {out}/checkpoints/step-00000005 "
                                   "at step 5; resume with checkpoint.resume=latest")
    assert saved(out) == ["step-00000005"] and not (out / "model").exists()
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["step"], run["checkpoint"]) == ("preempted", 5, f"{out}/checkpoints/step-00000005")
    resumed = train(str(path), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert losses(out) == losses(straight_out)
    assert [step for step, _ in losses(out)] == list(range(1, 13))


def test_an_external_sigterm_stops_at_a_step_boundary(tmp_path, make_config):
    path, out = write(tmp_path, make_config, "run", epochs=100)  # 600 steps: far more than the test waits
    proc = subprocess.Popen([sys.executable, "-m", "posttune.cli.main", "train", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED, stderr[-3000:]
    last = losses(out)[-1][0]
    assert 3 <= last < 600 and saved(out) == [f"step-{last:08d}"]  # the checkpoint is the last logged step


def test_a_sigterm_during_the_final_save_lets_it_finish(tmp_path, make_config):
    """Dying in the final save would leave no model and, with save_every null, no checkpoint: a requeued run would
    start at step 0. The save finishes, the run is complete (exit 0) and says so."""
    path, out = write(tmp_path, make_config, "run", epochs=1)
    result = train(str(path), fault=("final_term", 0))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "posttune: SIGTERM during the final save: it finished, and the run is complete" in result.stderr
    assert (out / "model" / "model.safetensors").is_file() and (out / "summary.json").is_file()


@pytest.mark.extended
def test_a_second_sigterm_exits_at_once(tmp_path, make_config):
    path, out = write(tmp_path, make_config, "run")
    result = train(str(path), fault=("term2", 3))  # the second one arrives while the checkpoint is due
    assert result.returncode == -signal.SIGTERM
    assert not (out / "checkpoints").exists() or saved(out) == []


@pytest.mark.extended
def test_a_preempted_run_keeps_keep_last_checkpoints(tmp_path, make_config):
    """keep_last 2, saves every 2, SIGTERM after step 5: step-4 (trusted) and step-5 (on probation until
    the resumed run's first step) stay; step-2 went (before, keep_last + 1 were kept: three)."""
    path, out = write(tmp_path, make_config, "run")
    config = yaml.safe_load(path.read_text())
    config["checkpoint"].update(save_every=2, keep_last=2)
    path.write_text(yaml.safe_dump(config))
    stopped = train(str(path), fault=("term", 5))
    assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    assert saved(out) == ["step-00000004", "step-00000005"]


@pytest.mark.parametrize("gap, survives", [(0.05, True), (2.5, False)])
def test_a_second_sigterm_within_two_seconds_is_the_same_request(gap, survives):
    """SLURM signals every process of a step and torchrun forwards its own SIGTERM: two 50 ms apart are one request
    (the run goes on to its checkpoint); asked again after ``DUPLICATE_S``, it stops at once (killed by it)."""
    child = (f"import os, signal, time\nfrom posttune.training import preemption\nwith preemption.watching():\n"
             f"    os.kill(os.getpid(), signal.SIGTERM); time.sleep({gap}); os.kill(os.getpid(), signal.SIGTERM)\n"
             f"    time.sleep(0.2); print('requested', preemption.requested())\n")
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    if survives:
        assert (result.returncode, result.stdout.strip()) == (0, "requested True"), result.stderr
    else:
        assert result.returncode == -signal.SIGTERM and result.stdout == ""
