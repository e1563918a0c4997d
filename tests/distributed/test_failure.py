"""A rank that raises ends the whole torchrun job with that rank's error; nothing hangs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import env, write_config

pytestmark = pytest.mark.slow

#: Rank 1 raises in its first optimizer step while rank 0 waits in the same step's all-reduce.
FAILING_WORKER = textwrap.dedent("""
    import os, sys
    import posttune.training.trainer as trainer
    from posttune.training import worker

    step = trainer._optimizer_step

    def failing_step(session, window, log):
        if os.environ["RANK"] == "1":
            raise RuntimeError("boom on rank 1")
        return step(session, window, log)

    trainer._optimizer_step = failing_step
    sys.exit(worker.run(sys.argv[1:]))
""")


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]})
    script = tmp_path / "failing_worker.py"
    script.write_text(FAILING_WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(script), str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env())
    assert result.returncode != 0
    assert "boom on rank 1" in result.stderr


def test_posttune_train_reports_the_failing_rank_in_one_line(tmp_path):
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]})
    # a checkpoint path that exists on no rank: every worker fails while loading it
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), "model.path=" + str(tmp_path),
               "model.family=llama", "--nproc-per-node", "2", "--standalone"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env())
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("posttune: error: ") and "config.json" in last, result.stderr[-2000:]
