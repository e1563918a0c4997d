"""metrics.jsonl as the trainer writes and reads it: ``train.log_every`` averages the steps between records but
never hides a skipped (non-finite) step, and a torn last line (a kill mid-write) is dropped on reading while a
broken line before it is an error naming it."""

from __future__ import annotations

import pytest

from posttune.errors import PosttuneError
from posttune.training.metrics import MetricsLog, read_metrics


def test_a_skipped_step_is_its_own_record_whatever_log_every(tmp_path):
    log = MetricsLog(tmp_path, total_steps=10, initial_step=0, enabled=True, log_every=5, trackers=None)
    for step in range(1, 6):
        if step == 3:  # as the trainer writes a step skipped for a non-finite gradient
            log.write({"step": 3, "epoch": 0, "lr": 1e-3, "skipped_nonfinite": "grad norm"})
        else:
            log.write({"step": step, "lr": 1e-3, "loss": float(step), "grad_norm": 1.0, "tokens": 10,
                       "tokens_per_s": 10.0})
    log.close()
    records = read_metrics(tmp_path)
    assert [(r["step"], r.get("skipped_nonfinite")) for r in records] == [(3, "grad norm"), (5, None)]
    assert records[1]["loss"] == pytest.approx((1 + 2 + 4 + 5) / 4)  # the logged steps' mean, the skipped one out


def test_a_torn_last_line_is_dropped_and_a_broken_earlier_one_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.8}\n')
    with pytest.raises(PosttuneError, match=r"metrics.jsonl: line 2 is not JSON$"):
        read_metrics(tmp_path)
