"""``train.warmup_ratio``: the warmup of a recipe written for transformers' Trainer, over the same steps."""

from __future__ import annotations

import pytest

from posttune.config.schema import TrainConfig, validate
from posttune.errors import ConfigError
from posttune.training.optim import lr_lambda, warmup_steps

RUN = {"model": {"family": "llama", "size": "tiny"}, "method": "sft",
       "data": {"train": {"path": "train.jsonl"}}}


@pytest.mark.parametrize("ratio", [0.0, 0.03, 0.1, 0.25, 0.5])
@pytest.mark.parametrize("total", [1, 7, 100, 333])
def test_a_ratio_warms_up_over_the_steps_transformers_trainer_counts(ratio, total, tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_steps=ratio, report_to=[])
    assert warmup_steps(TrainConfig(warmup_ratio=ratio), total) == reference.get_warmup_steps(total)


def test_the_schedule_reaches_the_peak_after_the_ratio_of_the_run():
    warmup = warmup_steps(TrainConfig(warmup_ratio=0.1, scheduler="cosine"), 100)
    factor = lr_lambda("cosine", warmup, 100)
    assert warmup == 10 and factor(9) < 1.0 and factor(10) == 1.0 and factor(99) < 0.01


@pytest.mark.parametrize("train, message", [
    ({"warmup_ratio": 0.1, "warmup_steps": 5}, "train.warmup_ratio: train.warmup_steps (5) sets the warmup too; "
                                               "keep one (train.warmup_steps=0 to use the ratio)"),
    ({"warmup_ratio": 1.0}, "train.warmup_ratio: expected a number >= 0 and < 1"),
    ({"warmup_steps": 0.03}, "train.warmup_steps: 0.03 is a fraction (transformers reads a warmup_steps below 1 as a "
                             "ratio of the run); set train.warmup_ratio: 0.03"),
])
def test_two_warmups_a_full_ratio_and_a_fractional_step_count_are_refused(train, message):
    with pytest.raises(ConfigError) as info:
        validate({**RUN, "train": train})
    assert str(info.value).startswith(f"config: {message}"), str(info.value)
