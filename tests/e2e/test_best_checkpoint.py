"""``checkpoint.best_metric``: the best checkpoint survives pruning and is named; ``train.early_stopping_patience``
ends the run when the metric stops improving (transformers' ``metric_for_best_model`` and ``EarlyStoppingCallback``).
The expected steps are worked out from the run's own metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from posttune.config.schema import validate
from posttune.errors import ConfigError
from posttune.training.best import Best
from posttune.training.metrics import read_metrics

# greater_is_better on val_loss: the best checkpoint is an early one, which keep_last alone would delete
JUDGED = {"best_metric": "val_loss", "greater_is_better": True, "save_every": 2, "keep_last": 1}


def run(posttune_cli, write_config, tmp_path, save_every=2, **train):
    path = write_config(train={"epochs": 2, "eval_every": 2, **train}, checkpoint={**JUDGED, "save_every": save_every},
                        data={"validation": {"path": str(tmp_path / "train.jsonl"), "format": "chat"}})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    scores = {r["step"]: r["val_loss"] for r in read_metrics(out) if "val_loss" in r}
    return out, scores, json.loads((out / "summary.json").read_text()), result


def test_the_best_checkpoint_is_kept_beside_the_last_and_named(llama_sft, posttune_cli, write_config, tmp_path):
    out, scores, summary, _ = run(posttune_cli, write_config, tmp_path)
    assert sorted(scores) == [2, 4, 6, 8, 10, 12] and len(set(scores.values())) > 1
    best = max(sorted(scores), key=lambda step: scores[step])  # the earliest of the highest
    assert best != 12  # else the test would not tell keeping the best from keeping the last
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [f"step-{best:08d}", "step-00000012"]
    assert summary["best_step"] == best and summary["best_val_loss"] == scores[best]
    assert summary["best_checkpoint"] == str(out / "checkpoints" / f"step-{best:08d}")
    assert summary["final_step"] == 12 and "stopped_early" not in summary


@pytest.mark.parametrize("save_every", [2, 4])  # 4: the step it stops at had no checkpoint due; it gets one
def test_early_stopping_ends_the_run_after_patience_evaluations_without_a_better_one(llama_sft, posttune_cli,
                                                                                  write_config, tmp_path, save_every):
    out, scores, summary, result = run(posttune_cli, write_config, tmp_path, save_every, early_stopping_patience=2)
    steps = sorted(scores)
    best = steps[0]
    for step in steps[1:]:  # the run's own judgement, step by step, as transformers' callback makes it
        if scores[step] > scores[best]:
            best = step
        elif sum(1 for s in steps if best < s <= step) >= 2:
            stop = step
            break
    else:
        pytest.fail(f"val_loss kept rising: nothing to stop ({scores})")
    assert steps[-1] == stop == summary["final_step"] < 12
    said = result.stdout + result.stderr
    assert f"stopping early at step {stop}: val_loss has not improved for 2 evaluations" in said
    assert summary["stopped_early"].startswith("val_loss has not improved for 2 evaluations")
    assert (out / "checkpoints" / f"step-{stop:08d}").is_dir() and (out / "model" / "config.json").is_file()


def test_a_metric_the_evaluation_does_not_log_keeps_the_steps_run_for_a_resume(llama_sft, posttune_cli, write_config,
                                                                                tmp_path):
    """A typo in best_metric shows at the first evaluation, after steps of training: they are saved, and the run
    resumes with the metric fixed."""
    path = write_config(train={"epochs": 1, "eval_every": 2}, checkpoint={"best_metric": "val_los", "save_every": 4},
                        data={"validation": {"path": str(tmp_path / "train.jsonl"), "format": "chat"}})
    result = posttune_cli("train", str(path))
    saved = tmp_path / "out" / "checkpoints" / "step-00000002"
    assert result.exit_code == 2 and result.stderr.strip().endswith(
        "config: checkpoint.best_metric: the evaluation logs no 'val_los' (it logs: val_loss); step 2 is saved in "
        f"{saved}: fix it and resume (checkpoint.resume=latest)")
    assert saved.is_dir()
    result = posttune_cli("train", str(path), "checkpoint.best_metric=val_loss", "checkpoint.resume=latest")
    assert result.exit_code == 0, result.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out")][:2] == [1, 2]


def test_a_resumed_run_judges_with_the_evaluations_before_it():
    config = validate({**RUN, "checkpoint": {"best_metric": "val_loss"}, "train": {"eval_every": 2,
                                                                                     "early_stopping_patience": 2}})
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.0}, {"step": 4, "val_loss": 1.5},
               {"step": 6, "val_loss": 1.6}]
    best = Best.of(config, records)
    assert best.scores == {2: 2.0, 4: 1.5, 6: 1.6} and best.best_step() == 4 and best.stop_reason() is None
    best.evaluated(8, {"val_loss": 1.5, "val_tokens": 10})  # equal is not better
    assert best.stop_reason().startswith("val_loss has not improved for 2 evaluations (best 1.5 at step 4")
    with pytest.raises(ConfigError, match=r"checkpoint.best_metric: the evaluation logs no 'val_loss' \(it logs: "
                                          r"val_reward\)"):
        best.evaluated(10, {"val_reward": 1.0})


RUN = {"model": {"family": "llama", "size": "tiny"}, "method": "sft",
       "data": {"train": {"path": "train.jsonl"}, "validation": {"path": "val.jsonl"}}}


@pytest.mark.parametrize(("sections", "message"), [
    ({"checkpoint": {"best_metric": "loss"}, "train": {"eval_every": 2}},
     "checkpoint.best_metric: 'loss' is not an evaluation's metric; name one it logs, e.g. val_loss"),
    ({"checkpoint": {"best_metric": "val_loss"}}, "checkpoint.best_metric: needs evaluations: set train.eval_every"),
    ({"checkpoint": {"best_metric": "val_loss", "save_every": 3}, "train": {"eval_every": 2}},
     "checkpoint.save_every: with checkpoint.best_metric it must be a multiple of train.eval_every (2)"),
    ({"train": {"eval_every": 2, "early_stopping_patience": 3}},
     "train.early_stopping_patience: set checkpoint.best_metric too"),
    ({"checkpoint": {"greater_is_better": True}}, "checkpoint.greater_is_better: set checkpoint.best_metric too"),
    ({"checkpoint": {"best_metric": "val_loss"}, "train": {"eval_every": 2, "early_stopping_patience": 0}},
     "train.early_stopping_patience: expected a positive integer"),
])
def test_a_best_metric_without_scored_checkpoints_is_refused_before_launch(sections, message):
    with pytest.raises(ConfigError) as info:
        validate({**RUN, **sections})
    assert str(info.value).startswith(f"config: {message}"), str(info.value)
