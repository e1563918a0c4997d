"""Going on from a finished run: its final step is a resumable checkpoint (raise `train.max_steps`
and `resume: latest` to extend it, bitwise), or its adapter starts a new run (`adapter.init_from`)."""

from __future__ import annotations

import json

import torch
import yaml

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
