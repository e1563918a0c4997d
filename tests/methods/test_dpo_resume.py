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


def test_log_every_records_after_a_resume_average_what_the_uninterrupted_runs_do(make_dpo_config, tmp_path):
    """``train.log_every: 3``: the checkpoint at step 4 holds step 4's record, not yet written; the resumed run's
    record at step 6 averages steps 4-6 as the uninterrupted run's does (not 5-6)."""
    def config(path):
        return make_dpo_config(path, rows=24, train={"epochs": 2, "lr": 3e-3, "log_every": 3},
                               checkpoint={"save_every": 2, "keep_last": 2})

    expected = killed_and_resumed(tmp_path, config, ("loss", "rewards/margin", "pairs"))
    assert [step for step, *_ in expected] == [3, 6, 9, 12]
