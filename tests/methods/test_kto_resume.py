"""KTO resumes exactly: SIGKILL mid-epoch, `resume: latest`, and the per-step losses, the reference point and
the reward metrics are bitwise those of the uninterrupted run (the feedback rows' labels travel in the loader's
resumable store, the mismatched pairs are made per batch)."""

from __future__ import annotations

import pytest
from kill_support import killed_and_resumed
from run_support import kto_config

# the DPO family's resume (tests/methods/test_dpo_resume.py) is in the default run; tox -e extended runs KTO's
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_sigkill_mid_epoch_then_resume_gives_the_same_kto_losses(tmp_path):
    def config(path):  # 24 feedback rows, batch 4: 6 steps an epoch, the kill at step 5 mid-epoch 0
        return kto_config(path, prompts=12, train={"epochs": 2, "lr": 3e-3},
                          checkpoint={"save_every": 2, "keep_last": 2})

    expected = killed_and_resumed(tmp_path, config, ("loss", "kl", "rewards/chosen", "rewards/rejected"))
    assert [step for step, *_ in expected] == list(range(1, 13))
    assert any(kl > 0 for _, _, kl, *_ in expected)  # the reference point moved off 0 at some step
