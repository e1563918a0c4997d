"""The non-finite guard: a NaN/Inf loss or gradient norm stops the run at that step in one line
(exit 2) without saving it, or is skipped `train.skip_nonfinite` times; weights an infinite
learning rate made NaN or Inf are never written over a good model."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml
from fault_support import error_line, train, tree_digest
from run_support import dpo_config

pytestmark = pytest.mark.slow


@pytest.fixture
def config(tmp_path, make_config):
    """6 steps (24 rows, batch 4), a checkpoint after every step, all kept."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_config(tmp_path, train={"device": "cpu"},
                                               checkpoint={"save_every": 1, "keep_last": 10})))
    return path, tmp_path / "out"


def steps_saved(out, suffix: str = "") -> list[int]:
    """The steps of the checkpoints kept (``suffix=".unstable"``: of those marked unstable)."""
    root = out / "checkpoints"
    return sorted(int(p.name[5:len(p.name) - len(suffix)]) for p in root.iterdir()
                  if re.fullmatch(rf"step-\d+{re.escape(suffix)}", p.name)) if root.is_dir() else []


def test_a_nan_loss_stops_the_run_at_that_step_without_saving_it(config):
    path, out = config
    result = train(str(path), fault=("nan_loss", 3))
    assert result.returncode == 2
    assert error_line(result) == ("posttune: error: train: step 3: the loss is nan; stopped (train.skip_nonfinite lets "
                                  "a run skip such steps), without saving this step; the last trusted checkpoint is "
                                  "step-00000001 (checkpoint.resume=latest continues from it)")
    # step 3 ran on step 2's weights: that checkpoint is set aside, and resume: latest takes step 1
    assert steps_saved(out) == [1] and steps_saved(out, ".unstable") == [2] and not (out / "model").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and run["error"] == error_line(result).removeprefix("posttune: error: ")


def test_an_infinite_gradient_is_skipped_within_the_allowance(config):
    path, out = config
    result = train(str(path), "train.skip_nonfinite=1", fault=("inf_grad", 2))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["skipped_nonfinite"] == 1
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert records[2] == {"step": 2, "epoch": 0, "lr": 1e-3, "skipped_nonfinite": "grad norm"}
    weights = [tree_digest(out / "checkpoints" / f"step-{s:08d}" / "model")["model.safetensors"] for s in (1, 2)]
    assert weights[0] == weights[1]  # the skipped step left the weights alone


def test_a_skipped_step_still_runs_the_evaluation_due_at_it(config):
    """The step counts: with best_metric every checkpoint is scored, so the one saved at a skipped step is too."""
    path, out = config
    result = train(str(path), "train.skip_nonfinite=1", "train.eval_every=1", "data.validation_split=0.25",
                   "checkpoint.best_metric=val_loss", fault=("inf_grad", 2))
    assert result.returncode == 0, result.stderr
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert records[2]["skipped_nonfinite"] == "grad norm" and "loss" not in records[2]
    assert records[2]["val_loss"] == records[1]["val_loss"]  # the same weights, the same validation loss
    assert all("val_loss" in records[step] for step in records)


def test_past_the_allowance_the_run_stops_naming_the_step(config):
    path, out = config
    result = train(str(path), "train.skip_nonfinite=1", fault=("inf_grad_twice", 2))
    assert result.returncode == 2
    assert error_line(result).startswith("posttune: error: train: step 3: the grad norm is inf; stopped after "
                                         "skipping 1 such step(s) (train.skip_nonfinite: 1)")
    assert steps_saved(out) == [1] and steps_saved(out, ".unstable") == [2]


def test_a_diverging_run_never_writes_over_a_good_model(config):
    path, out = config
    assert train(str(path), "train.max_steps=2").returncode == 0
    good = tree_digest(out / "model")
    diverged = train(str(path), "checkpoint.overwrite=true", "train.lr=1e30")  # finite, but the weights overflow
    assert diverged.returncode == 2
    assert error_line(diverged).startswith("posttune: error: train: step 2: the ")
    poisoned = train(str(path), "checkpoint.overwrite=true", fault=("nan_weight", 2))
    assert poisoned.returncode == 2
    assert error_line(poisoned) == ("posttune: error: train: step 2: the trained weights hold NaN or Inf (is train.lr "
                                    f"too large?); stopped before writing checkpoint {out}/checkpoints/step-00000002, "
                                    "which would hold them")
    assert steps_saved(out) == [1] and tree_digest(out / "model") == good


@pytest.mark.extended
def test_an_overflowing_run_keeps_the_last_trusted_checkpoint_and_resumes_with_a_lower_lr(config):
    """lr 1e30: step 1 leaves weights that are finite (~1e29) but give a NaN/Inf at step 2. That
    checkpoint is set aside; with none left, a resume starts afresh, and a lowered train.lr applies
    (before, every resume picked the poisoned checkpoint and ignored the new learning rate)."""
    path, out = config
    blown = ["train.lr=1e30", "checkpoint.keep_last=1"]
    result = train(str(path), *blown)
    assert result.returncode == 2
    line = error_line(result)
    assert line.startswith("posttune: error: train: step ") and line.endswith(
        "; no trusted checkpoint is left (checkpoint.resume=latest starts afresh)"), line
    assert line.startswith("posttune: error: train: step 2: "), line
    assert steps_saved(out) == [] and steps_saved(out, ".unstable") == [1]
    resumed = train(str(path), "checkpoint.keep_last=1", "train.lr=0.05", "checkpoint.resume=latest",
                    "train.max_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: no checkpoint yet in {out}, starting at step 0" in resumed.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["lr"] == 0.05 for r in records)
    assert steps_saved(out) == [3]  # keep_last 1: the last step's checkpoint, trusted at the end of the run


def test_an_exploding_step_sets_the_checkpoint_it_ran_on_aside(tmp_path):
    """Probation in isolation: a checkpoint is trusted after a calm step and set aside after an
    exploding one; only the newest set-aside checkpoint is kept."""
    import types

    from posttune.training import nonfinite, state

    root = tmp_path / "out" / state.CHECKPOINTS
    session = types.SimpleNamespace(resume_from=None, run_id="r", config=types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(keep_last=1, output_dir=str(tmp_path / "out"))))
    notes: list[str] = []

    def save(step: int):
        directory = root / f"step-{step:08d}"
        directory.mkdir(parents=True)
        (directory / state.STATE_FILE).write_text(json.dumps({"step": step, "run_id": "r"}))
        probation.saved(session, directory)

    probation = nonfinite.Probation(session, [{"loss": 2.0, "grad_norm": 1.0}, {"loss": 1.8, "grad_norm": 1.2}])
    save(1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    probation.judge(session, 1.7, 1.1, notes.append)  # calm: step 1 is trusted
    save(2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]  # 1 stays while 2 is judged
    probation.judge(session, 1.6, 150.0, notes.append)  # over 100x the median grad norm
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002.unstable"]
    assert notes == ["warning: checkpoint step-00000002.unstable is unstable: the step after it had grad norm 150, "
                     "over 100x the run's median 1.1; resume: latest skips it"]
    save(3)
    probation.judge(session, 500.0, 1.0, notes.append)  # the loss this time: over 100x its median
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003.unstable"]
    save(4)
    probation.judge(session, 1.5, 1.0, notes.append)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003.unstable", "step-00000004"]


@pytest.mark.extended
def test_probation_keeps_keep_last_when_the_trusted_checkpoint_is_among_them(tmp_path):
    """keep_last 2: while the newest checkpoint is on probation the trusted one before it is one of the
    2 kept already; keeping a third (as before) broke keep_last. keep_last 1 keeps both for the step."""
    import types

    from posttune.training import nonfinite, state

    root = tmp_path / "out" / state.CHECKPOINTS
    for keep_last, on_probation in ((2, ["step-00000002", "step-00000003"]), (1, ["step-00000002", "step-00000003"])):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        session = types.SimpleNamespace(resume_from=None, run_id="r", config=types.SimpleNamespace(
            checkpoint=types.SimpleNamespace(keep_last=keep_last, output_dir=str(tmp_path / "out"))))
        probation = nonfinite.Probation(session)
        for step in (1, 2, 3):
            directory = root / f"step-{step:08d}"
            directory.mkdir(parents=True)
            (directory / state.STATE_FILE).write_text(json.dumps({"step": step, "run_id": "r"}))
            probation.saved(session, directory)
            if step < 3:
                probation.judge(session, 1.0, 1.0, print)  # trusted
        assert sorted(p.name for p in root.iterdir()) == on_probation, keep_last  # 3 is on probation
        probation.finish(session)
        assert sorted(p.name for p in root.iterdir()) == on_probation[-keep_last:]


def test_a_skipped_step_still_ends_as_a_step_for_the_method(tmp_path):
    """TR-DPO syncs its reference every step, also at a skipped one (the step counts: without the step end, a
    run's reference sync -- or GRPO's weight push to its rollout actors -- due at that step never happened)."""
    config = dpo_config(tmp_path, rows=16, method={"name": "dpo", "beta": 0.5, "sync_reference_every": 1,
                                                   "sync_reference_alpha": 0.5},
                        train={"device": "cpu", "skip_nonfinite": 1}, checkpoint={"save_every": 1, "keep_last": 10})
    path, out = tmp_path / "run.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(config))
    result = train(str(path), fault=("inf_grad", 2))
    assert result.returncode == 0, result.stderr
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert records[2]["skipped_nonfinite"] == "grad norm"
    references = [torch.load(out / "checkpoints" / f"step-{s:08d}" / "method-00000.pt", weights_only=True)["reference"]
                  for s in (1, 2)]
    moved = [name for name in references[0] if not torch.equal(references[0][name], references[1][name])]
    assert moved and len(moved) == len(references[0])  # every weight moved halfway to the (unchanged) policy


def test_the_skips_allowed_are_counted_across_a_resume(config):
    """``train.skip_nonfinite: 1`` is one skip for the whole run: a resumed run does not get a fresh allowance."""
    path, out = config
    first = train(str(path), "train.skip_nonfinite=1", "train.max_steps=3", fault=("inf_grad", 2))
    assert first.returncode == 0, first.stderr
    assert json.loads((out / "summary.json").read_text())["skipped_nonfinite"] == 1
    resumed = train(str(path), "train.skip_nonfinite=1", "checkpoint.resume=latest", fault=("inf_grad", 5))
    assert resumed.returncode == 2
    assert error_line(resumed).startswith("posttune: error: train: step 5: the grad norm is inf; stopped after "
                                          "skipping 1 such step(s) (train.skip_nonfinite: 1)")
