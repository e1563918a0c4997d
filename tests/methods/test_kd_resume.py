"""Distillation resumes exactly: SIGKILL mid-run, `resume: latest`, and the per-step losses are bitwise
those of the uninterrupted run -- off-policy, and on-policy (GKD) where which batches the student
samples itself, and what it samples, must come out the same after the restart."""

from __future__ import annotations

import pytest
from kill_support import killed_and_resumed
from run_support import kd_config, save_hf_teacher

pytestmark = pytest.mark.slow


# the on-policy run takes both paths (a fraction of its steps); tox -e extended runs the off-policy one too
@pytest.mark.parametrize("on_policy_fraction", [pytest.param(0.0, marks=pytest.mark.extended), 0.5],
                         ids=["off_policy", "on_policy"])
def test_sigkill_then_resume_gives_the_same_distillation_steps(tmp_path, on_policy_fraction):
    teacher = save_hf_teacher(tmp_path / "teacher")

    def config(path):  # killed at step 5, resumed from step 3's checkpoint
        return kd_config(path, teacher, rows=24, method={"on_policy_fraction": on_policy_fraction, "max_new_tokens": 6},
                         train={"max_steps": 8, "grad_accum_steps": 2, "lr": 3e-3},
                         checkpoint={"save_every": 3, "keep_last": 2})

    expected = killed_and_resumed(tmp_path, config, ("loss", "divergence", "on_policy", "grad_norm"))
    assert [step for step, *_ in expected] == list(range(1, 9))
    on_policy_share = sum(r[3] for r in expected) / len(expected)
    assert (on_policy_share == 0) if on_policy_fraction == 0 else (0 < on_policy_share < 1)
