"""A sharded (DCP) checkpoint written by 2 FSDP2 ranks resumes on 2 ranks and on 1 process,
continuing the loss curve of the uninterrupted run within 1e-5; ``checkpoint.best_metric`` keeps and names the
best sharded checkpoint, which resumes."""

from __future__ import annotations

import json

import pytest

from conftest import env, metrics, train, write_config
from rank_support import run_ranks

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


SAVE_PROGRAM = r"""
import json, sys, time
from pathlib import Path
from types import SimpleNamespace
import torch, torch.distributed as dist
from posttune.training import sharded_state
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, target = dist.get_rank(), Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
optimizer.step()
session = SimpleNamespace(trainable=model, optimizer=optimizer)
saw = []

def each_rank(tmp):
    time.sleep(1.0 if rank == 1 else 0.0)  # the slow rank writes its own file last
    (tmp / f"each-{rank}").write_text("x")

def rest(tmp):
    saw.extend(sorted(p.name for p in tmp.iterdir()))
    time.sleep(1.0)  # rank 0 is slow to finish the directory
    (tmp / "rest").write_text("x")

sharded_state.save(session, target, rest, replaceable=("rest",), write_each_rank=each_rank)
in_place = sorted(p.name for p in target.iterdir())
saved = {k: v.clone() for k, v in model.state_dict().items()}
moments = optimizer.state[model.weight]["exp_avg"].clone()
with torch.no_grad():
    model.weight.add_(1.0)
optimizer.state[model.weight]["exp_avg"].zero_()
sharded_state.load(session, target)
restored = torch.equal(model.weight, saved["weight"]) and torch.equal(optimizer.state[model.weight]["exp_avg"], moments)
print(json.dumps({"saw": saw, "in_place": in_place, "restored": restored}))
from posttune.training import distributed
distributed.shutdown()
distributed.exit_process(0)
"""


def test_every_rank_s_files_are_in_place_before_rank_0_finishes_and_on_return(tmp_path):
    """`sharded_state.save` on 2 gloo ranks, a slow rank 1 writing its per-rank file (DPO/GRPO's method state) and a
    slow rank 0 finishing the directory: rank 0 writes the rest (the manifest) only once every rank's files are in
    the temporary directory, and every rank returns only once the checkpoint is in place (the barriers). Loaded
    back on both ranks, the weights and Adam's moments are the saved ones."""
    target = tmp_path / "step-00000001"
    results = run_ranks(SAVE_PROGRAM, str(target), env=env(), timeout=120)
    assert results[0]["saw"] == ["each-0", "each-1", "sharded"]
    for result in results:
        assert result["in_place"] == ["each-0", "each-1", "rest", "sharded"]
        assert result["restored"]
    assert not [p.name for p in tmp_path.iterdir() if p.name != target.name]  # no temporary directory left


def test_gather_adapters_takes_every_adapter_tensor_and_a_score_head():
    """What a sharded LoRA run saves as its adapter (`gather_adapters`, here in one process where each value is
    whole): every adapter tensor and, for a reward model, the score head that trains beside them. Without the head
    the saved reward model would score with a random one."""
    import torch

    from posttune_lora.layer import apply_lora
    from posttune.api import build_model
    from posttune.checkpoint.score_head import SCORE_HEAD, add_score_head
    from posttune.training.sharded_state import gather_adapters

    torch.manual_seed(0)
    model = add_score_head(build_model("llama", size="tiny"))
    apply_lora(model, targets=["attn.q_proj", "mlp.down_proj"], rank=2)
    expected = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    expected[SCORE_HEAD] = model.get_parameter(SCORE_HEAD)
    gathered = gather_adapters(model)
    assert sorted(gathered) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(gathered[name], tensor.detach()), name
