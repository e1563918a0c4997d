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


def test_a_warmup_as_long_as_the_run_warns_that_the_peak_is_never_reached(capsys):
    """axolotl's ``warmup_steps: 10`` kept for a 7-step run: it trains, below train.lr throughout, and says so."""
    import torch

    from posttune.training.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    scheduler = build_scheduler(optimizer, TrainConfig(lr=2e-4, warmup_steps=10, scheduler="cosine"), 7)
    rates = []
    for _ in range(7):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert max(rates) < 2e-4
    assert capsys.readouterr().err == (f"posttune: warning: train.warmup_steps: 10 warm-up steps in a run of 7: the "
                                       f"learning rate never reaches train.lr (0.0002); it ends at {rates[-1]:.3g}\n")
    build_scheduler(optimizer, TrainConfig(lr=2e-4, warmup_steps=6, scheduler="cosine"), 7)  # peak at the last step
    assert capsys.readouterr().err == ""
