"""Distillation on 2 gloo ranks trains exactly like one process (fp32, per step, 1e-5): FSDP2 with full
fine-tuning and the teacher sharded too, off-policy and on-policy (the student's samples depend on
the run seed and the dataset row only, so 1 and 2 ranks draw the same ones), FSDP2 with a LoRA
student, and tensor parallelism (both models split, the plain loss on gathered logits)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TIMEOUT, env, metrics, write_config
from run_support import save_hf_teacher

pytestmark = pytest.mark.slow

TOL = 1e-5
SCRIPT = Path(__file__).with_name("role_sharding.py")
KEYS = ("loss", "grad_norm", "divergence", "ce", "on_policy")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> dict:
    path = save_hf_teacher(tmp_path_factory.mktemp("kd-teacher") / "teacher")
    return {"path": str(path), "family": "llama"}


def assert_same_curve(run: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in run] == [r["step"] for r in reference] == [1, 2, 3, 4]
    for got, want in zip(run, reference, strict=True):
        assert got["labelled_tokens"] == want["labelled_tokens"] and got["tokens"] == want["tokens"]
        for key in KEYS:
            assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (got["step"], key, got[key], want[key])
    assert run[-1]["loss"] != reference[0]["loss"]  # it trained


def method(on_policy_fraction: float = 0.0, **settings) -> dict:
    return {"name": "kd", "kd_ratio": 0.5, "chunk_size": 16, "on_policy_fraction": on_policy_fraction,
            "max_new_tokens": 6, **settings}


# the on-policy run takes the off-policy path too (a fraction of its steps); tox -e extended runs both
@pytest.mark.parametrize("on_policy_fraction", [pytest.param(0.0, marks=pytest.mark.extended), 0.5],
                         ids=["off_policy", "on_policy"])
def test_kd_under_fsdp2_matches_one_process(runs, teacher, on_policy_fraction):
    name = "kd_on" if on_policy_fraction else "kd_off"
    kd = method(on_policy_fraction)
    single = runs(f"{name}_single", batch_size=8, method=kd, teacher=teacher)
    sharded = runs(f"{name}_fsdp2", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]}, method=kd, teacher=teacher)
    reference = metrics(single)
    assert_same_curve(metrics(sharded), reference)
    if on_policy_fraction:
        assert 0 < sum(r["on_policy"] for r in reference) < len(reference)


@pytest.mark.extended
def test_kd_with_a_lora_student_under_fsdp2_matches_one_process(runs, teacher):
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0}
    single = runs("kd_lora_single", batch_size=8, method=method(), teacher=teacher, adapter=lora)
    sharded = runs("kd_lora_fsdp2", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]}, method=method(),
                   teacher=teacher, adapter=lora)
    assert_same_curve(metrics(sharded), metrics(single))


def test_kd_under_tensor_parallelism_matches_one_process(runs, teacher):
    """TP splits both heads over the vocabulary: chunk_size null, full logits gathered."""
    single = runs("kd_off_single", batch_size=8, method=method(), teacher=teacher)
    split = runs("kd_tp", nproc=2, batch_size=8, parallel={"plans": ["tp"]}, method=method(chunk_size=None),
                 teacher=teacher)
    assert_same_curve(metrics(split), metrics(single))


def test_the_teacher_is_sharded_like_the_student(tmp_path, teacher):
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]}, method={"name": "kd"},
                          teacher=teacher)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(SCRIPT),
               str(config), "teacher"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env())
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert found["all_dtensors"] and found["frozen"] and found["policy_frozen_params"] == 0
    # KD's chunked loss reads the teacher's head after its forward: the root stays gathered until the loss frees it
    assert not found["sharded_after_forward"]
    assert found["placements"] == ["(Shard(dim=0),)"]
    assert found["local_values"] * 2 <= found["full_values"] + 2 * 384
