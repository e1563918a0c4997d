"""A sharded (DCP) checkpoint written by 2 FSDP2 ranks resumes on 2 ranks and on 1 process,
continuing the loss curve of the uninterrupted run within 1e-5; ``checkpoint.best_metric`` keeps and names the
best sharded checkpoint, which resumes."""

from __future__ import annotations

import json

import pytest

from conftest import env, metrics, train, write_config

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


def test_a_sharded_checkpoint_exports_as_a_model_on_one_process(runs, tmp_path):
    """docs/parallel.md's recipe: resumed on one process with nothing left to train, a sharded checkpoint's
    weights are written as the run's model (HF). Compared with torch's own DCP reader (dcp_to_torch_save)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import posttune

    straight = runs("fsdp2_saving", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]},
                    checkpoint={"save_every": 2})
    checkpoint = straight / "checkpoints" / "step-00000002"
    exported = tmp_path / "step2"
    result = train(straight / "config.yaml", "~parallel", f"checkpoint.resume={checkpoint}",
                   f"checkpoint.output_dir={exported}", "train.max_steps=2", "train.batch_size=8",
                   "checkpoint.save_every=null")
    assert json.loads((exported / "summary.json").read_text())["steps_run"] == 0, result.stdout
    dcp_to_torch_save(checkpoint / "sharded", tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
    model = posttune.load_model(exported / "model").state_dict()
    assert set(model) <= set(saved)
    for name, tensor in model.items():
        assert torch.equal(tensor, saved[name].to(tensor.dtype)), name
    assert not torch.equal(model["embed.weight"],
                           posttune.load_model(straight / "model").state_dict()["embed.weight"])  # step 2, not 4


def test_a_sharded_checkpoint_missing_a_rank_s_shard_is_named_not_a_traceback(runs, tmp_path):
    """As rank 0 saved it on node-local disks (before `check_shared` refused that layout): rank 1's shard absent
    and the manifest listing what rank 0 could see. Named, it is refused in one line (`latest` skips a checkpoint
    this check finds damaged, as it skips any other)."""
    import shutil
    import subprocess
    import sys

    straight = runs("fsdp2_saving", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]},
                    checkpoint={"save_every": 2})
    checkpoint = tmp_path / "step-00000002"
    shutil.copytree(straight / "checkpoints" / "step-00000002", checkpoint)
    (checkpoint / "sharded" / "__1_0.distcp").unlink()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["sharded/__1_0.distcp"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(straight / "config.yaml"),
               f"checkpoint.resume={checkpoint}", f"checkpoint.output_dir={tmp_path / 'resumed'}",
               "train.batch_size=8", "~parallel"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"posttune: error: checkpoint.resume: {checkpoint} is damaged (sharded/__1_0.distcp is missing (written "
        "where rank 0 could not see it?)); name another checkpoint or use checkpoint.resume=latest")


def test_the_best_sharded_checkpoint_is_kept_named_and_resumes(tmp_path):
    """2 FSDP2 ranks, ``keep_last: 1``, the best by ``val_loss`` judged higher-is-better (so an early step, which
    pruning alone would delete): it is kept beside the last, the summary names it (a ``sharded/`` checkpoint),
    and a run resumes from it at the step after it."""
    directory = tmp_path / "best"
    config = write_config(directory, batch_size=4, parallel={"plans": ["fsdp2"]}, steps=6,
                          checkpoint={"save_every": 2, "keep_last": 1, "best_metric": "val_loss",
                                      "greater_is_better": True})
    validation = (f"data.validation.path={directory / 'train.jsonl'}", "data.validation.format=chat",
                  "train.eval_every=2")
    train(config, *validation, nproc=2)
    out = directory / "out"
    scores = {r["step"]: r["val_loss"] for r in metrics(out) if "val_loss" in r}
    assert sorted(scores) == [2, 4, 6] and len(set(scores.values())) > 1
    best = max(sorted(scores), key=lambda step: scores[step])
    assert best != 6  # else keeping the best would not be told from keeping the last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_step"] == best and summary["best_val_loss"] == scores[best]
    kept = out / "checkpoints" / f"step-{best:08d}"
    assert summary["best_checkpoint"] == str(kept) and (kept / "sharded").is_dir()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [kept.name, "step-00000006"]

    train(config, *validation, f"checkpoint.output_dir={tmp_path / 'resumed'}", f"checkpoint.resume={kept}",
          nproc=2)
    assert [r["step"] for r in metrics(tmp_path / "resumed") if "loss" in r][0] == best + 1


@pytest.mark.parametrize("adapter", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_an_unsharded_checkpoint_resumes_on_two_fsdp2_ranks(runs, tmp_path, adapter):
    """The other way round: a checkpoint of one process (``model/`` or ``adapter/``, ``optimizer.pt`` whole)
    resumed by 2 FSDP2 ranks, each taking its shard of the weights and of Adam's moments, with the same global
    batch: the loss curve of the uninterrupted run goes on."""
    name = "single_saving" if adapter is None else "lora_single_saving"
    straight = runs(name, batch_size=8, adapter=adapter, checkpoint={"save_every": 2})
    checkpoint = straight / "checkpoints" / "step-00000002"
    assert (checkpoint / "optimizer.pt").is_file() and not (checkpoint / "sharded").exists()
    expected = {r["step"]: r["loss"] for r in metrics(straight)}
    config = write_config(tmp_path, batch_size=4, adapter=adapter, parallel={"plans": ["fsdp2"]})
    train(config, f"checkpoint.output_dir={tmp_path / 'two'}", f"checkpoint.resume={checkpoint}", nproc=2)
    resumed = metrics(tmp_path / "two")
    assert [r["step"] for r in resumed] == [3, 4]
    for record in resumed:
        assert abs(record["loss"] - expected[record["step"]]) <= TOL, record["step"]


def test_an_adapter_starts_a_run_on_two_fsdp2_ranks(runs, tmp_path):
    """``adapter.init_from`` under FSDP2: each rank loads its shard of the saved adapter; the run's losses are the
    single process's."""
    lora = {"rank": 4, "alpha": 8}
    saved = runs("lora_single_saving", batch_size=8, adapter=lora, checkpoint={"save_every": 2}) / "adapter"
    config = write_config(tmp_path, batch_size=8, adapter={**lora, "init_from": str(saved)}, steps=2)
    train(config, f"checkpoint.output_dir={tmp_path / 'one'}")
    train(config, f"checkpoint.output_dir={tmp_path / 'two'}", "train.batch_size=4", "parallel.plans=[fsdp2]",
          nproc=2)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]
    assert one[0]["loss"] < metrics(saved.parent)[0]["loss"]  # it starts where the saved run ended, not afresh
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= TOL, a["step"]
