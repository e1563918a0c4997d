"""DPO resumes exactly: SIGKILL mid-epoch, `resume: latest`, and the per-step losses (and the
reward metrics) are bitwise those of the uninterrupted run, with a live, a precomputed or a synced (TR-DPO)
reference."""

from __future__ import annotations

import pytest
from kill_support import killed_and_resumed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", [{}, pytest.param({"precompute_reference": True}, marks=pytest.mark.extended),
                                    {"sync_reference_every": 3, "sync_reference_alpha": 0.5}],
                         ids=["live", "precomputed", "tr_dpo"])
def test_sigkill_mid_epoch_then_resume_gives_the_same_dpo_losses(make_dpo_config, tmp_path, method):
    """TR-DPO's reference, synced at step 3, is resumed from step 4's checkpoint (the kill is at step 5)."""
    def config(path):  # 24 pairs, batch 4: 6 steps an epoch, the kill at step 5 mid-epoch 0
        return make_dpo_config(path, rows=24, method={"name": "dpo", "beta": 0.5, **method},
                               train={"epochs": 2, "lr": 3e-3}, checkpoint={"save_every": 2, "keep_last": 2})

    expected = killed_and_resumed(tmp_path, config, ("loss", "rewards/margin", "logps/chosen"))
    assert [step for step, *_ in expected] == list(range(1, 13))
