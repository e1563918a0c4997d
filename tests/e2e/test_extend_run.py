"""Going on from a finished run: its final step is a resumable checkpoint (raise `train.max_steps`
and `resume: latest` to extend it, bitwise), or its adapter starts a new run (`adapter.init_from`)."""

from __future__ import annotations

import json

import torch
import yaml

from posttune.descriptors import MemoryTechnique
from posttune.plugins import hookimpl
from posttune.training import save_final
from posttune.training.metrics import read_metrics
from posttune.training.trainer import train
from run_support import compose_run, sft_config


def losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(out)]


def test_a_finished_run_extends_to_the_losses_of_a_longer_one(llama_sft, posttune_cli, tmp_path):
    paths = {}
    for name, steps in (("straight", 6), ("extended", 4)):
        config = sft_config(tmp_path / name, train={"max_steps": steps}, checkpoint={"save_every": 2, "keep_last": 5})
        paths[name] = tmp_path / name / "run.yaml"
        paths[name].write_text(yaml.safe_dump(config))
        result = posttune_cli("train", str(paths[name]))
        assert result.exit_code == 0, result.stderr
    out = tmp_path / "extended" / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    refused = posttune_cli("train", str(paths["extended"]), "train.max_steps=6")  # a finished run is not reused
    assert refused.exit_code == 2 and "holds another run's results" in refused.stderr
    extended = posttune_cli("train", str(paths["extended"]), "train.max_steps=6", "checkpoint.resume=latest")
    assert extended.exit_code == 0, extended.stderr
    assert f"resumed from step 4 ({out / 'checkpoints' / 'step-00000004'})" in extended.stdout
    assert "config changed since the checkpoint: train.max_steps 4 -> 6" in extended.stdout
    assert losses(out) == losses(tmp_path / "straight" / "out")  # bitwise, constant schedule
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps_run"], summary["final_step"]) == (2, 6)


def test_an_extended_cosine_run_continues_on_the_longer_schedule(llama_sft, posttune_cli, tmp_path):
    """The first extra step trained at the finished schedule's last rate (0 for cosine): the optimizer's rate was
    restored, not the longer schedule's value at that step."""
    rates = {}
    for name, steps in (("straight", 6), ("extended", 4)):
        config = sft_config(tmp_path / name, train={"max_steps": steps, "scheduler": "cosine", "lr": 1e-3},
                            checkpoint={"save_every": 2})
        (tmp_path / name / "run.yaml").write_text(yaml.safe_dump(config))
        assert posttune_cli("train", str(tmp_path / name / "run.yaml")).exit_code == 0
    extended = posttune_cli("train", str(tmp_path / "extended" / "run.yaml"), "train.max_steps=6",
                            "checkpoint.resume=latest")
    assert extended.exit_code == 0, extended.stderr
    for name in ("straight", "extended"):
        records = (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()
        rates[name] = [json.loads(line)["lr"] for line in records]
    assert rates["extended"][4:] == rates["straight"][4:] and rates["extended"][4] > 0


def adapter_config(tmp_path, **adapter):
    return sft_config(tmp_path, train={"max_steps": 3, "lr": 1e-2}, adapter={"rank": 4, "alpha": 8, **adapter})


def test_init_from_starts_exactly_where_the_finished_adapter_is(llama_sft, posttune_cli, tmp_path):
    finished = compose_run(adapter_config(tmp_path / "first"))
    train(finished)
    save_final(finished)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        expected = finished.model.eval()(ids)
    saved = tmp_path / "first" / "out" / "adapter"
    started = compose_run(adapter_config(tmp_path / "second", init_from=str(saved)))
    with torch.no_grad():
        assert torch.equal(started.model.eval()(ids), expected)
    fresh = compose_run(adapter_config(tmp_path / "third"))
    with torch.no_grad():
        assert not torch.equal(fresh.model.eval()(ids), expected)  # the adapter really moved the output

    mismatched = tmp_path / "rank8.yaml"
    mismatched.write_text(yaml.safe_dump(adapter_config(tmp_path / "rank8", init_from=str(saved), rank=8)))
    result = posttune_cli("train", str(mismatched))
    assert result.exit_code == 2
    assert result.stderr == (f"posttune: error: config: adapter.init_from: {saved} does not match this run's "
                             "adapter: rank 4 (saved) vs 8 (adapter.rank)\n")


def test_a_resume_below_the_checkpoints_step_is_refused_before_anything_is_written(llama_sft, posttune_cli,
                                                                                   write_config, tmp_path):
    """Before, `train.max_steps` below the resumed step trained nothing, exited 0 and rewrote config.yaml
    and the final model as a run of fewer steps than it holds. At the step itself it finishes the run."""
    from fault_support import tree_digest

    path = write_config(train={"max_steps": 4}, checkpoint={"save_every": 2})
    assert posttune_cli("train", str(path)).exit_code == 0
    out = tmp_path / "out"
    def results() -> dict[str, str]:  # what the run left (run.json and the lock are rewritten by every start)
        return {name: digest for name, digest in tree_digest(out).items() if name not in ("run.json", ".posttune.lock")}

    before = results()
    checkpoint = out / "checkpoints" / "step-00000004"
    for command in ("validate", "train"):
        result = posttune_cli(command, str(path), "train.max_steps=3", "checkpoint.resume=latest")
        assert result.exit_code == 2, result.stdout
        assert result.stderr == (f"posttune: error: config: train.max_steps: 3 is below the step already trained: "
                                 f"the checkpoint to resume ({checkpoint}) is at step 4; set train.max_steps to 4 or "
                                 "more to continue that run, or start afresh without checkpoint.resume, with "
                                 "checkpoint.overwrite=true (or another checkpoint.output_dir)\n")
    # epochs instead of max_steps: 24 rows at batch 4 with 2 accumulation steps are 3 steps an epoch (known once
    # the data is read)
    by_epochs = posttune_cli("train", str(path), "~train.max_steps", "train.grad_accum_steps=2",
                             "checkpoint.resume=latest")
    assert by_epochs.exit_code == 2, by_epochs.stdout
    assert by_epochs.stderr.startswith(f"posttune: error: config: train.epochs: 1 epoch(s) make 3 steps, fewer than "
                                       f"already trained: the checkpoint to resume ({checkpoint}) is at step 4; "
                                       "raise train.epochs (or set train.max_steps to 4 or more)")
    assert results() == before  # config.yaml, model/, metrics.jsonl, summary.json: untouched
    finished = posttune_cli("train", str(path), "checkpoint.resume=latest")  # at the step: the run is finished
    assert finished.exit_code == 0, finished.stderr
    assert json.loads((out / "summary.json").read_text())["steps_run"] == 0


RESUME = ("checkpoint.resume=latest", "train.max_steps=4")


def two_steps_saved(posttune_cli, tmp_path, config: dict):
    """``config`` trained 2 steps with a checkpoint there, whose resume (``RESUME``) validates: (its path, the
    checkpoint)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert posttune_cli("train", str(path)).exit_code == 0
    assert posttune_cli("validate", str(path), *RESUME).exit_code == 0
    return path, tmp_path / "out" / "checkpoints" / "step-00000002"


def test_a_resume_with_another_global_batch_is_refused_by_validate(llama_sft, register_plugin, posttune_cli, tmp_path):
    """The data position counts global batches (train.batch_size x data-parallel ranks): a resume that reads it
    with another is refused before launch (train refused it only once the model had loaded), naming the batch size
    that reads it on this launch's ranks."""
    import posttune_fsdp2

    register_plugin(posttune_fsdp2, distribution="posttune-fsdp2", version="0.1.0")
    path, checkpoint = two_steps_saved(posttune_cli, tmp_path, sft_config(
        tmp_path, train={"max_steps": 2, "batch_size": 2}, checkpoint={"save_every": 2}))
    resume = RESUME
    for extra, fits in ((("train.batch_size=4",), "set train.batch_size=2 to continue it on 1 data-parallel rank"),
                        (("parallel.plans=[fsdp2]", "--nproc-per-node", "2"),
                         "set train.batch_size=1 to continue it on 2 data-parallel ranks")):
        result = posttune_cli("validate", str(path), *resume, *extra)
        assert result.exit_code == 2
        assert result.stderr == (f"posttune: error: config: train.batch_size: checkpoint {checkpoint}: cannot resume "
                                 "the data position: the checkpoint's global batch is 2 rows (train.batch_size x "
                                 f"data-parallel ranks) and this run's 4; {fits}\n")
    reseeded = posttune_cli("validate", str(path), *resume, "train.seed=5")  # the seed orders the data: likewise
    assert reseeded.exit_code == 2
    assert reseeded.stderr == (f"posttune: error: config: train.seed: checkpoint {checkpoint}: its data order was "
                               "drawn with seed 0, this run has 5; set train.seed: 0 to resume it\n")
    in_order = posttune_cli("validate", str(path), *resume, "data.shuffle=false")  # and an order read as it is
    assert in_order.exit_code == 2
    assert in_order.stderr == (f"posttune: error: config: data.shuffle: checkpoint {checkpoint}: its data order was "
                               "shuffled (seed 0), this run reads the rows in order; set data.shuffle: true to "
                               "resume it\n")



def test_a_checkpoint_and_an_evaluation_at_the_end_of_every_epoch(llama_sft, posttune_cli, tmp_path):
    """``checkpoint.save_every: epoch`` (torchtune's cadence, HF's save_strategy="epoch"): 10 rows of 2 with 2
    accumulation steps are 3 steps an epoch (the last one of a single micro-batch); a resume from the first
    epoch's checkpoint continues the run's losses bitwise. Streamed data has no epoch length: refused before
    launch; with best_metric an epoch must be a multiple of eval_every (refused once the data is read), or
    ``train.eval_every: epoch`` too."""
    config = sft_config(tmp_path, rows=10, train={"epochs": 2, "grad_accum_steps": 2},
                        checkpoint={"save_every": "epoch", "keep_last": 5})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert posttune_cli("train", str(path)).exit_code == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    straight = losses(out)
    resumed = posttune_cli("train", str(path), f"checkpoint.resume={out / 'checkpoints' / 'step-00000003'}",
                           f"checkpoint.output_dir={tmp_path / 'resumed'}")
    assert resumed.exit_code == 0, resumed.stderr
    assert losses(tmp_path / "resumed") == straight[3:]

    streamed = posttune_cli("validate", str(path), "data.train.streaming=true", "train.max_steps=4")
    assert streamed.exit_code == 2 and streamed.stderr == (
        "posttune: error: config: checkpoint.save_every: epoch (give a number of steps) is not possible with "
        "streaming data (the epoch length is unknown)\n")
    scored = posttune_cli("train", str(path), "checkpoint.best_metric=val_loss", "train.eval_every=3",
                          "data.validation_split=0.2", f"checkpoint.output_dir={tmp_path / 'scored'}")
    assert scored.exit_code == 2  # 8 training rows: 2 steps an epoch
    assert scored.stderr.endswith("checkpoint.save_every: with checkpoint.best_metric its 2 steps must be a multiple "
                                  "of train.eval_every's 3, so that every checkpoint is scored\n")
    # evaluated at the end of every epoch too (HF's eval_strategy="epoch"): each checkpoint scored, the best kept
    both = posttune_cli("train", str(path), "checkpoint.best_metric=val_loss", "train.eval_every=epoch",
                        "data.validation_split=0.2", f"checkpoint.output_dir={tmp_path / 'both'}")
    assert both.exit_code == 0, both.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "both") if "val_loss" in r] == [2, 4]
    assert json.loads((tmp_path / "both" / "summary.json").read_text())["best_step"] in (2, 4)


def test_a_resume_that_would_shuffle_rows_read_in_order_is_refused_by_validate(llama_sft, posttune_cli, tmp_path):
    """The other way round from the test above: a checkpoint of a ``data.shuffle: false`` run saves no seed; a
    resume that shuffles passed validate and failed once the model had loaded ("seed=None, this run has 0")."""
    config = sft_config(tmp_path, train={"max_steps": 2}, checkpoint={"save_every": 2})
    config["data"]["shuffle"] = False
    path, checkpoint = two_steps_saved(posttune_cli, tmp_path, config)
    for command in ("validate", "train"):
        shuffled = posttune_cli(command, str(path), *RESUME, "data.shuffle=true")
        assert shuffled.exit_code == 2
        assert shuffled.stderr == (f"posttune: error: config: data.shuffle: checkpoint {checkpoint}: its rows were "
                                   "read in order (data.shuffle: false), this run shuffles them; set data.shuffle: "
                                   "false to resume it\n")


class FreezeEmbedding:
    """A third party's technique that changes which weights train (the embedding frozen)."""

    POSTTUNE_PLUGIN_API = 2

    @staticmethod
    def apply(session, target) -> None:
        target.model.get_parameter("embed.weight").requires_grad_(False)

    @hookimpl
    def posttune_register_memory_techniques(self, register):
        register(MemoryTechnique("freeze_embedding", "adapt", self.apply))


def test_a_resume_whose_trainable_weights_changed_is_refused_in_one_line(llama_sft, register_plugin, posttune_cli,
                                                                          tmp_path):
    """The optimizer's state is per trained weight: torch's ValueError came out as a traceback (a plugin author)."""
    register_plugin(FreezeEmbedding(), name="freeze", distribution="posttune-freeze", version="0.1.0")
    config = sft_config(tmp_path, train={"max_steps": 2}, checkpoint={"save_every": 2}, memory=["freeze_embedding"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert posttune_cli("train", str(path)).exit_code == 0
    resumed = posttune_cli("train", str(path), "checkpoint.resume=latest", "train.max_steps=4", "memory=[]")
    assert resumed.exit_code == 2, resumed.stderr
    checkpoint = tmp_path / "out" / "checkpoints" / "step-00000002"
    assert resumed.stderr.startswith(f"posttune: error: cannot resume {checkpoint}: its optimizer state is for other "
                                     "trainable parameters than this run's (")
    assert resumed.stderr.endswith("; the settings that choose them (adapter, memory techniques that freeze or add "
                                   "weights) changed: resume with the checkpoint's, or start a new run from its "
                                   "model\n") and resumed.stderr.count("\n") == 1
