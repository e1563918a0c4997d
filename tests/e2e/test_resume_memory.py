"""A resumed run does not keep its history resident: metrics.jsonl's records, read to judge checkpoints (probation,
the best one), are dropped before the first step. A week-long run logging every step resumes with hundreds of
thousands of records (~1 KiB each in Python): a soak test measured a resumed run's resident memory 913 MiB instead
of 609 MiB for the whole run with 300,000 of them."""

from __future__ import annotations

import weakref

from run_support import sft_config

import posttune
from posttune.training import trainer


def test_a_resumed_run_drops_the_metrics_history_before_training(llama_sft, tmp_path, monkeypatch):
    config = sft_config(tmp_path, train={"max_steps": 2}, checkpoint={"save_every": 2})
    assert posttune.train(config)["final_step"] == 2

    class Records(list):  # a plain list cannot be weakly referenced
        pass

    read, histories, alive = trainer.read_metrics, [], []

    def reading(output_dir):
        records = Records(read(output_dir))
        histories.append(weakref.ref(records))
        return records

    step = trainer._optimizer_step

    def stepping(*args, **kwargs):
        alive.append([ref() is not None for ref in histories])
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "read_metrics", reading)
    monkeypatch.setattr(trainer, "_optimizer_step", stepping)
    summary = posttune.train(config, "train.max_steps=4", "checkpoint.resume=latest")
    assert summary["final_step"] == 4 and summary["steps_run"] == 2
    assert alive == [[False], [False]]  # read once (two records), and no longer held at either step
