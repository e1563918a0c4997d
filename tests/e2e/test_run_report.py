"""What a run tells its user: the banner, OUTPUT/config.yaml (reloadable, diffed on resume),
one line per evaluation with no second one at the end, `log_every`, and the summary."""

from __future__ import annotations

import json

import pytest
import yaml

from posttune.config import load_config, validate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.training import trainer
from posttune.training.metrics import read_metrics
from posttune.training.run_report import config_changes, resolved_config


def test_the_saved_config_reloads_to_the_same_resolved_config(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"max_steps": 2}, adapter={"rank": 4, "alpha": 8})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    saved = tmp_path / "out" / "config.yaml"
    plan = resolve_plan(validate(load_config(path)), get_registry())
    reloaded = resolve_plan(validate(load_config(saved)), get_registry())
    assert resolved_config(reloaded) == resolved_config(plan) == yaml.safe_load(saved.read_text())
    assert resolved_config(plan)["method"]["name"] == "sft" and len(resolved_config(plan)["method"]) > 1
    banner = result.stdout.split("== summary ==")[0]
    assert "model: llama size tiny (random init), method sft, lora rank 4 alpha 8" in banner
    assert "parameters: " in banner and " trainable (" in banner
    assert "data: 24 samples, 6 batches an epoch, " in banner
    assert "steps: 2 (0.333 epoch(s) of 6 steps); effective batch 4 = 4 x 1 accumulation x 1" in banner
    assert f"output: {tmp_path / 'out'} (config.yaml, metrics.jsonl)" in banner


def test_a_resume_names_what_changed_in_the_config(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"max_steps": 2}, checkpoint={"save_every": 2})
    assert posttune_cli("train", str(path)).exit_code == 0
    result = posttune_cli("train", str(path), "checkpoint.resume=latest", "train.lr=0.002")
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("config changed")]
    assert lines == ["config changed since the checkpoint: train.lr 0.001 -> 0.002 (the new learning rate "
                     "applies: the schedule continues from the checkpoint's step)"]
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in logged] == [(1, 0.001), (2, 0.001)]  # the run had ended at max_steps 2
    assert f"resumed from step 2 ({tmp_path / 'out' / 'checkpoints' / 'step-00000002'})" in result.stdout
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["train"]["lr"] == 0.002  # overwritten
    again = posttune_cli("train", str(path), "checkpoint.resume=latest", "train.lr=0.004", "train.max_steps=3")
    assert again.exit_code == 0, again.stderr
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 3 and logged[-1]["lr"] == 0.004  # a constant schedule: exactly the new rate


def test_a_resume_compares_with_the_config_its_checkpoint_trained_under(llama_sft, posttune_cli, write_config,
                                                                         tmp_path):
    """Not with the folder's last config.yaml: step 2 trained at 0.001 whatever a later resume set, and a resume
    into another folder (which has no config.yaml yet) still names what it changes."""
    path = write_config(train={"max_steps": 2}, checkpoint={"save_every": 1, "keep_last": 5})
    assert posttune_cli("train", str(path)).exit_code == 0
    assert posttune_cli("train", str(path), "checkpoint.resume=latest", "train.lr=0.002", "train.max_steps=3"
                        ).exit_code == 0
    step_2 = tmp_path / "out" / "checkpoints" / "step-00000002"

    def changed(*overrides) -> list[str]:
        result = posttune_cli("train", str(path), f"checkpoint.resume={step_2}", *overrides)
        assert result.exit_code == 0, result.stderr
        return [line for line in result.stdout.splitlines() if line.startswith("config changed")]

    assert changed("train.max_steps=3") == ["config changed since the checkpoint: train.max_steps 2 -> 3"]
    assert changed("train.max_steps=3", f"checkpoint.output_dir={tmp_path / 'elsewhere'}", "train.lr=0.003") == [
        f'config changed since the checkpoint: checkpoint.output_dir "{tmp_path / "out"}" -> '
        f'"{tmp_path / "elsewhere"}", '
        "train.lr 0.001 -> 0.003, train.max_steps 2 -> 3 (the new learning rate applies: the schedule continues "
        "from the checkpoint's step)"]


def test_config_changes_are_dotted_keys():
    old = {"train": {"lr": 0.001, "max_steps": 4}, "checkpoint": {"resume": None}, "memory": []}
    new = {"train": {"lr": 0.002, "max_steps": 4}, "checkpoint": {"resume": "latest"}, "memory": ["compile"]}
    assert config_changes(old, new) == ['memory [] -> ["compile"]', "train.lr 0.001 -> 0.002"]
    # a setting added since the old file was written, off (null): not a change; set, it is one
    assert config_changes({"method": {"name": "sft"}}, {"method": {"name": "sft", "neftune_alpha": None}}) == []
    # a section empty on one side is said once, by its keys (not also "parallel.dims {} -> (unset)")
    assert config_changes({"parallel": {"dims": {}}}, {"parallel": {"dims": {"ep": 2}}}) == [
        "parallel.dims.ep (unset) -> 2"]
    assert config_changes({"method": {"name": "sft"}}, {"method": {"name": "sft", "neftune_alpha": 5.0}}) == [
        "method.neftune_alpha (unset) -> 5.0"]
    # how this invocation starts (resume, overwrite) is not the run's configuration
    assert config_changes({"checkpoint": {"overwrite": False, "resume": None}},
                          {"checkpoint": {"overwrite": True, "resume": "latest"}}) == []


@pytest.mark.parametrize("batches, accumulation, steps, expected", [
    (10, 4, 6, "6 (2 epoch(s) of 3 steps)"),
    (8, 4, 4, "4 (2 epoch(s) of 2 steps)"),
])
def test_the_banner_counts_an_epochs_partial_accumulation_as_a_step(batches, accumulation, steps, expected):
    """As the trainer steps: an epoch of 10 batches at accumulation 4 is 3 optimizer steps (4 + 4 + 2)."""
    from types import SimpleNamespace

    from posttune.training.run_report import describe_steps

    session = SimpleNamespace(total_steps=steps, train_data=list(range(batches)),
                              config=SimpleNamespace(train=SimpleNamespace(grad_accum_steps=accumulation)))
    assert describe_steps(session) == expected


def test_log_every_evaluations_and_no_second_evaluation_at_the_end(llama_sft, posttune_cli, write_config, tmp_path,
                                                                   monkeypatch):
    calls = []
    evaluate = trainer.evaluate
    monkeypatch.setattr(trainer, "evaluate", lambda session: calls.append(session.step) or evaluate(session))
    path = write_config(train={"max_steps": 6, "log_every": 2, "eval_every": 3})
    result = posttune_cli("train", str(path), f"data.validation.path={tmp_path / 'train.jsonl'}",
                          "data.validation.format=chat")
    assert result.exit_code == 0, result.stderr
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # every 2nd step, the evaluation at 3, the last
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert calls == [3, 6]  # the end of the run reuses step 6's evaluation
    evaluations = [line for line in result.stdout.splitlines() if ": val_loss " in line]
    assert evaluations == [f"step {r['step']}: val_loss {r['val_loss']:.4f}" for r in records if "val_loss" in r]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["val_loss"] == records[-1]["val_loss"]
    assert f"  val_loss         {summary['val_loss']:,.6g}" in result.stdout


def test_log_every_keeps_the_last_step(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"max_steps": 5, "log_every": 2})
    assert posttune_cli("train", str(path)).exit_code == 0
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [2, 4, 5]


def test_the_summary_counts_this_invocations_steps(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"max_steps": 2}, checkpoint={"save_every": 1})
    first = posttune_cli("train", str(path))
    assert first.exit_code == 0, first.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps_run"] == 2
    resumed = posttune_cli("train", str(path), "checkpoint.resume=latest", "train.max_steps=5")
    assert resumed.exit_code == 0, resumed.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["steps_run"], summary["final_step"]) == (3, 5)
    assert summary["tokens"] == sum(r["tokens"] for r in read_metrics(tmp_path / "out")[2:])
    shown = resumed.stdout.split("== summary ==")[1].splitlines()
    assert "  steps_run        3" in shown and "  final_step       5" in shown


def test_resume_latest_without_a_checkpoint_names_no_change(llama_sft, posttune_cli, write_config, tmp_path):
    """A run stopped before its first checkpoint leaves config.yaml and none: `resume: latest` starts at step 0,
    so nothing is "changed since the checkpoint" (before, it compared with the old config.yaml). A finished run
    without one is refused instead (test_training.py)."""
    path = write_config(train={"max_steps": 1})
    assert posttune_cli("train", str(path)).exit_code == 0
    run = tmp_path / "out" / "run.json"
    run.write_text(json.dumps({**json.loads(run.read_text()), "status": "interrupted"}))  # Ctrl-C before a save
    result = posttune_cli("train", str(path), "checkpoint.resume=latest", "train.lr=0.002")
    assert result.exit_code == 0, result.stderr
    assert f"resume: no checkpoint yet in {tmp_path / 'out'}, starting at step 0" in result.stdout
    assert "changed since the checkpoint" not in result.stdout
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["train"]["lr"] == 0.002


def test_the_banner_counts_packed_rows_and_says_1_batch(llama_sft, posttune_cli, write_config, tmp_path):
    """With packing an item is a row of several samples: the banner names both counts, found from the
    loader alone (no method named), and a single batch is "1 batch"."""
    from posttune.training.run_report import count

    path = write_config(train={"max_steps": 1, "batch_size": 8}, method={"name": "sft", "packing": True},
                        data={"max_seq_len": 256})
    result = posttune_cli("train", str(path), f"data.validation.path={tmp_path / 'train.jsonl'}",
                          "data.validation.format=chat")
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("data: "))
    train, validation = line.removeprefix("data: ").split("; validation ")
    assert train == validation
    assert train.startswith("24 samples packed into ") and ", 1 batch an epoch, " in train, line
    rows = int(train.removeprefix("24 samples packed into ").split(" ")[0])
    assert 1 < rows < 24  # several samples a row
    assert (count(1, "batch", "batches"), count(2, "batch", "batches"), count(1_000, "row")) == (
        "1 batch", "2 batches", "1,000 rows")


def test_eval_every_without_validation_data_is_named_in_the_banner(llama_sft, posttune_cli, write_config):
    """Nothing to evaluate on: the run goes on (a shared config may set eval_every), but says so once."""
    result = posttune_cli("train", str(write_config(train={"max_steps": 1, "eval_every": 1})))
    assert result.exit_code == 0, result.stderr
    assert ("evaluation: none (train.eval_every is 1, but there is no data.validation to evaluate on)"
            in result.stdout.splitlines())



def test_a_logged_record_averages_the_steps_since_the_last_as_hf_trainer_does(llama_sft, posttune_cli,
                                                                             write_config, tmp_path):
    """log_every 2 writes step 2's record with loss, tokens/s and tokens the mean of steps 1 and 2, and lr and
    grad_norm step 2's own (HF Trainer's logging_steps); the run itself is the one logged every step."""
    every = write_config("every.yaml", train={"max_steps": 5})
    assert posttune_cli("train", str(every)).exit_code == 0
    steps = read_metrics(tmp_path / "out")
    sparse = write_config("sparse.yaml", train={"max_steps": 5, "log_every": 2}, checkpoint={"overwrite": True})
    assert posttune_cli("train", str(sparse)).exit_code == 0
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [2, 4, 5]
    for record, window in zip(records, (steps[0:2], steps[2:4], steps[4:5]), strict=True):
        assert record["loss"] == pytest.approx(sum(r["loss"] for r in window) / len(window), rel=1e-6)
        assert record["tokens"] == pytest.approx(sum(r["tokens"] for r in window) / len(window))
        assert (record["lr"], record["grad_norm"]) == pytest.approx((window[-1]["lr"], window[-1]["grad_norm"]))
        assert record["peak_memory_mib"] >= min(r["peak_memory_mib"] for r in window)
    assert records[0]["loss"] != pytest.approx(steps[1]["loss"])  # a mean, not step 2's own


def test_a_window_s_throughput_is_its_tokens_over_its_time():
    """Two steps of 100 tokens, at 100 and 300 tokens/s (1 s and 1/3 s): 200 tokens in 4/3 s is 150 tokens/s, not
    the rates' mean of 200; the loss is their mean, the peak memory their peak, lr the last step's."""
    from posttune.training.metrics import averaged

    steps = [{"step": 1, "lr": 1.0, "loss": 2.0, "tokens": 100, "tokens_per_s": 100.0, "peak_memory_mib": 10.0},
             {"step": 2, "lr": 0.5, "loss": 1.0, "tokens": 100, "tokens_per_s": 300.0, "peak_memory_mib": 8.0}]
    record = averaged(steps)
    assert record == {"step": 2, "lr": 0.5, "loss": 1.5, "tokens": 100.0, "tokens_per_s": pytest.approx(150.0),
                      "peak_memory_mib": 10.0}
    assert averaged(steps[:1]) == steps[0] and isinstance(averaged(steps[:1])["tokens"], int)
    # a metric a step left out (over no example) is the mean of the steps that logged it, kept when the last did not
    steps[0]["rewards/rejected"] = -0.5
    assert averaged(steps)["rewards/rejected"] == -0.5


def test_a_metric_over_no_example_is_left_out_of_the_step():
    """KTO's rewards/rejected of a step with only desirable examples: TRL leaves it out; a 0 would read as a
    log-probability of 0 (probability 1) on a plot."""
    from types import SimpleNamespace

    import torch

    from posttune.descriptors import LossOutput
    from posttune.training.trainer import Window

    window = Window()
    none, some = (torch.tensor(0.0), torch.tensor(0.0)), (torch.tensor(3.0), torch.tensor(2.0))
    window.add(LossOutput(torch.tensor(1.0), 1.0, metrics={"rewards/rejected": none, "rewards/chosen": some}))
    reduced = window.reduce(SimpleNamespace(mesh=None, device=torch.device("cpu")))
    assert reduced["rewards/chosen"] == 1.5 and "rewards/rejected" not in reduced
