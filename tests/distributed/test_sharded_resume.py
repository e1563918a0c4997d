"""A sharded (DCP) checkpoint written by 2 FSDP2 ranks resumes on 2 ranks and on 1 process,
continuing the loss curve of the uninterrupted run within 1e-5."""

from __future__ import annotations

import pytest

from conftest import metrics, train, write_config

pytestmark = pytest.mark.slow

TOL = 1e-5


def test_sharded_checkpoint_resumes_on_two_ranks_and_on_one(runs, tmp_path):
    straight = runs("fsdp2_saving", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]},
                    checkpoint={"save_every": 2})
    checkpoint = straight / "checkpoints" / "step-00000002"
    assert (checkpoint / "sharded").is_dir() and not (checkpoint / "model").exists()
    expected = {r["step"]: r["loss"] for r in metrics(straight)}

    config = write_config(tmp_path / "resumed", batch_size=4, parallel={"plans": ["fsdp2"]})
    train(config, f"checkpoint.output_dir={tmp_path / 'two'}", f"checkpoint.resume={checkpoint}", nproc=2)
    # one process: the same global batch (8 rows) in one micro-batch; the plans are inactive
    one = train(config, f"checkpoint.output_dir={tmp_path / 'one'}", f"checkpoint.resume={checkpoint}",
                "train.batch_size=8")
    assert "Warning" not in one.stderr, one.stderr  # DCP's "assuming ... a single process", at every load and save
    for name in ("two", "one"):
        resumed = metrics(tmp_path / name)
        assert [r["step"] for r in resumed] == [3, 4], name
        for record in resumed:
            assert abs(record["loss"] - expected[record["step"]]) <= TOL, (name, record["step"])
