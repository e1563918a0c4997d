"""Resume survives damage, and a failed write is one line that leaves what was there intact:
a checkpoint that no longer matches its manifest is skipped by `resume: latest` (refused when
named), a torn last metrics line is dropped, and a disk-full or permission error while saving
names the path, exits 2 and leaves the previous checkpoint and final model byte-identical."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from fault_support import error_line, train, tree_digest
from kill_support import losses, run
from posttune.training import manifest, state
from run_support import reversal_rows, tiny_run_config

pytestmark = pytest.mark.slow


def write(tmp_path, name: str, **checkpoint) -> tuple:
    """24 rows, batch 4: 6 steps an epoch, 2 epochs; a checkpoint every 2 steps, 3 kept."""
    config = tiny_run_config(tmp_path, reversal_rows(24), fmt="chat", base_method={"name": "sft"}, batch_size=4,
                             train={"epochs": 2, "lr": 3e-3}, checkpoint={"save_every": 2, "keep_last": 3,
                                                                          **checkpoint})
    config["checkpoint"]["output_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, tmp_path / name


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> list:
    tmp_path = tmp_path_factory.mktemp("straight")
    path, out = write(tmp_path, "straight")
    assert train(str(path)).returncode == 0
    return losses(out)


def killed_at_step_7(tmp_path) -> tuple:
    path, out = write(tmp_path, "killed")
    assert run(str(path), killer=("step", 7)).returncode == -9  # checkpoints 2, 4, 6
    return path, out


def test_resume_latest_skips_a_damaged_checkpoint_and_matches_the_uninterrupted_run(tmp_path, expected):
    path, out = killed_at_step_7(tmp_path)
    newest = out / "checkpoints" / "step-00000006"
    size = (newest / "optimizer.pt").stat().st_size
    with open(newest / "optimizer.pt", "r+b") as f:
        f.truncate(size // 2)
    named = train(str(path), f"checkpoint.resume={newest}")
    assert named.returncode == 2
    assert error_line(named) == (f"posttune: error: checkpoint.resume: {newest} is damaged (optimizer.pt has "
                                 f"{size // 2} bytes, expected {size}); name another checkpoint or use "
                                 "checkpoint.resume=latest")
    resumed = train(str(path), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    assert [line for line in resumed.stderr.splitlines() if "warning" in line] == [
        f"posttune: warning: checkpoint.resume: skipping damaged checkpoint {newest} (optimizer.pt has {size // 2} "
        f"bytes, expected {size})"]
    assert losses(out) == expected


@pytest.mark.extended
def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, expected):
    path, out = killed_at_step_7(tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "epoch": 1, "lo')  # killed in the middle of a line
    resumed = train(str(path), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(out) == expected


@pytest.mark.extended
def test_resume_latest_without_a_checkpoint_redoes_every_logged_step(tmp_path, expected):
    path, out = write(tmp_path, "early", save_every=None)
    assert run(str(path), killer=("step", 3)).returncode == -9  # logged 3 steps, saved none
    resumed = train(str(path), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(out) == expected


def test_a_manifest_catches_damage_and_an_older_checkpoint_without_one_is_accepted(tmp_path):
    checkpoint = tmp_path / "step-00000002"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "model.safetensors").write_bytes(b"w" * 64)
    (checkpoint / state.STATE_FILE).write_text(json.dumps({"step": 2, "epoch": 0, "run_id": "abc"}))
    manifest.write_manifest(checkpoint)
    assert state.checkpoint_damage(checkpoint) is None
    (checkpoint / "model" / "model.safetensors").write_bytes(b"x" * 64)
    assert state.checkpoint_damage(checkpoint) == "model/model.safetensors does not match its checksum"
    written = json.loads((checkpoint / manifest.MANIFEST).read_text())
    for outside in ("../../data/train.jsonl", str(tmp_path / "elsewhere")):  # a crafted manifest stats nothing else
        (checkpoint / manifest.MANIFEST).write_text(json.dumps({"files": {outside: {"size": 1, "sha256": "0"}}}))
        assert manifest.damage(checkpoint) == f"{manifest.MANIFEST} names {outside!r}, outside the checkpoint"
    (checkpoint / manifest.MANIFEST).write_text(json.dumps(written))
    (checkpoint / manifest.MANIFEST).unlink()  # as written before manifests existed: accepted unverified
    assert state.checkpoint_damage(checkpoint) is None
    (checkpoint / state.STATE_FILE).write_text("{")
    assert state.checkpoint_damage(checkpoint) == "trainer_state.json is unreadable"


@pytest.mark.parametrize("files", ['"x"', '{"model.safetensors": 5}', '{"model.safetensors": {"size": "5"}}'])
def test_a_manifest_of_another_shape_is_damage_not_a_traceback(tmp_path, files):
    (tmp_path / manifest.MANIFEST).write_text('{"version": 1, "files": ' + files + "}")
    assert manifest.damage(tmp_path) == f"{manifest.MANIFEST} is unreadable"


def test_a_checkpoint_written_with_a_manifest_that_lost_it_is_damaged(tmp_path):
    """Deleting manifest.json (a partial copy, a hand edit) must not turn verification off: only a checkpoint from
    before manifests existed, whose trainer state does not say it had one, is accepted unverified."""
    (tmp_path / state.STATE_FILE).write_text(json.dumps({"step": 2, "run_id": "abc", "manifest": manifest.MANIFEST}))
    manifest.write_manifest(tmp_path)
    assert state.checkpoint_damage(tmp_path) is None
    (tmp_path / manifest.MANIFEST).unlink()
    assert state.checkpoint_damage(tmp_path) == (f"{manifest.MANIFEST} is missing (the checkpoint was written with "
                                                 "one: its files cannot be verified)")


def test_resume_latest_weighs_a_checkpoint_whose_state_is_unreadable_and_prune_leaves_it(tmp_path):
    """Its lineage unknown, `latest` used to pass over it unsaid (a run resumed from an older step with no word);
    now it is a candidate, found damaged and named. Pruning, which must not delete another run's, still skips it."""
    from posttune.training.output_dir import lineage

    for step, text in ((2, json.dumps({"step": 2, "run_id": "abc"})), (4, "{")):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / state.STATE_FILE).write_text(text)
    assert [p.name for p in lineage(tmp_path, "abc")] == ["step-00000002"]
    assert [p.name for p in lineage(tmp_path, "abc", unreadable=True)] == ["step-00000002", "step-00000004"]
    assert state.checkpoint_damage(tmp_path / "step-00000004") == "trainer_state.json is unreadable"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple:
    """A finished 4-step run: model/ and the step-2 and step-4 (final) checkpoints."""
    tmp_path = tmp_path_factory.mktemp("finished")
    path, out = write(tmp_path, "run")
    assert train(str(path), "train.max_steps=4").returncode == 0
    return path, out


FREE = r"\d+\.\d (KiB|MiB|GiB|TiB) free on its disk"


@pytest.mark.parametrize(("fault", "what", "reason"), [
    ("enospc", "checkpoint {out}/checkpoints/step-00000006 (optimizer.pt)",
     f"No space left on device; {FREE}; the previous checkpoints are intact"),
    # another errno, and torch's RuntimeError as on a full disk: the same path, so tox -e extended runs them
    pytest.param("eacces", "checkpoint {out}/checkpoints/step-00000006 (optimizer.pt)",
                 f"Permission denied; {FREE}; the previous checkpoints are intact", marks=pytest.mark.extended),
    pytest.param("fsize", "checkpoint {out}/checkpoints/step-00000006 (optimizer.pt)",
                 rf"the write stopped short \(unexpected pos \d+ vs \d+\); {FREE}; the previous checkpoints are intact",
                 marks=pytest.mark.extended),
    ("final_enospc", "model {out}/model (model.safetensors)",
     f"No space left on device; {FREE}; any previous final model there is intact"),
])
def test_a_failed_write_is_one_line_and_leaves_the_previous_results_intact(finished, tmp_path, fault, what, reason):
    source, finished_out = finished
    out = tmp_path / "run"
    shutil.copytree(finished_out, out)
    config = yaml.safe_load(source.read_text())
    config["checkpoint"]["output_dir"] = str(out)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    before = tree_digest(out / "model"), tree_digest(out / "checkpoints" / "step-00000004")
    result = train(str(path), "checkpoint.resume=latest", "train.max_steps=6", "checkpoint.save_every=null"
                   if fault == "final_enospc" else "checkpoint.save_every=2", fault=(fault, 1))
    assert result.returncode == 2
    assert re.fullmatch(re.escape(f"posttune: error: cannot write {what.format(out=out)}: ") + reason,
                        error_line(result)), error_line(result)
    assert (tree_digest(out / "model"), tree_digest(out / "checkpoints" / "step-00000004")) == before
    assert not [p for p in [*out.iterdir(), *(out / "checkpoints").iterdir()] if ".tmp-" in p.name]


def test_a_write_cut_by_the_file_size_limit_says_the_limit():
    """`ulimit -f` stops a write as a full disk would, with torch's zip-writer words only: the limit is named."""
    import subprocess
    import sys

    program = ("import resource; from pathlib import Path; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (10 ** 6, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
               "from posttune.training.write_errors import torch_write_failed; "
               "print(torch_write_failed(RuntimeError('[enforce fail at inline_container.cc:1] unexpected pos 9 vs 7'),"
               " Path('optimizer.pt')))")
    said = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout.strip()
    assert said.endswith("the write stopped short (unexpected pos 9 vs 7); the process's file size limit (ulimit -f) "
                         "is 1000000 bytes: 'optimizer.pt'")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP saving in one process, as meant
def test_a_sharded_checkpoint_is_read_against_dcp_s_metadata_even_without_a_manifest(tmp_path):
    """A checkpoint from before manifests is accepted unverified, but its ``sharded/.metadata`` (DCP's own list of
    shard files) still guards the resume: garbage there, or a shard it names that is gone, is damage named in one
    line (``latest`` skips it), not a traceback from inside DCP's load."""
    import torch
    import torch.distributed.checkpoint as dcp

    (tmp_path / state.STATE_FILE).write_text(json.dumps({"step": 2, "run_id": "abc"}))
    dcp.save({"model": {"weight": torch.ones(3)}}, checkpoint_id=tmp_path / "sharded", no_dist=True)
    assert state.checkpoint_damage(tmp_path) is None
    metadata = tmp_path / "sharded" / ".metadata"
    written = metadata.read_bytes()
    metadata.write_bytes(b"not DCP metadata")
    assert re.fullmatch(r"sharded/\.metadata is unreadable \(\w+\)", state.checkpoint_damage(tmp_path) or "")
    metadata.write_bytes(written)
    (shard,) = (tmp_path / "sharded").glob("*.distcp")
    shard.unlink()
    assert state.checkpoint_damage(tmp_path) == (f"sharded/{shard.name} is missing (written where rank 0 could not "
                                                 "see it?)")
