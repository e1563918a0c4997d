"""Learning-rate schedules that decay to a floor (``train.min_lr_ratio``) and warmup-stable-decay (``wsd``),
against transformers' ``cosine_with_min_lr`` and ``warmup_stable_decay`` schedules on the same steps."""

from __future__ import annotations

import math

import pytest
import torch

from posttune.config.schema import TrainConfig, validate
from posttune.errors import ConfigError
from posttune.training.optim import build_scheduler, lr_lambda

transformers = pytest.importorskip("transformers")

RUN = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": {"path": "train.jsonl"}}}


def reference_factors(make, total: int) -> list[float]:
    """The LR multipliers a transformers schedule gives at optimizer steps 0 .. total - 1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make(optimizer)
    factors = []
    for _ in range(total):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step(), scheduler.step()
    return factors


@pytest.mark.parametrize("min_ratio", [0.0, 0.1, 0.5])
@pytest.mark.parametrize(("warmup", "total"), [(0, 1), (0, 50), (5, 50), (10, 333)])
def test_cosine_decays_to_the_floor_as_transformers_cosine_with_min_lr(min_ratio, warmup, total):
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    expected = reference_factors(lambda o: get_cosine_with_min_lr_schedule_with_warmup(
        o, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=min_ratio), total)
    factor = lr_lambda("cosine", warmup, total, min_ratio)
    # after the warmup (whose ramp starts above 0 here: docs/training.md) the decay is the same
    assert [factor(step) for step in range(warmup, total)] == pytest.approx(expected[warmup:], abs=1e-12)


@pytest.mark.parametrize("min_ratio", [0.0, 0.2])
@pytest.mark.parametrize(("warmup", "decay", "total"), [(0, 5, 50), (4, 10, 50), (10, 90, 100), (3, 1, 20)])
def test_wsd_holds_the_peak_then_decays_as_transformers_warmup_stable_decay(min_ratio, warmup, decay, total):
    from transformers.optimization import get_wsd_schedule

    expected = reference_factors(lambda o: get_wsd_schedule(
        o, num_warmup_steps=warmup, num_decay_steps=decay, num_training_steps=total, min_lr_ratio=min_ratio), total)
    factor = lr_lambda("wsd", warmup, total, min_ratio, decay)
    assert [factor(step) for step in range(warmup, total)] == pytest.approx(expected[warmup:], abs=1e-12)
    assert factor(total - decay) == 1.0 and factor(total - decay + 1) < 1.0  # the peak lasts until the decay


def test_linear_decays_to_the_floor_and_a_config_drives_the_schedule():
    factor = lr_lambda("linear", 0, 10, 0.25)
    assert [factor(step) for step in (0, 5, 10)] == pytest.approx([1.0, 0.625, 0.25])
    train = TrainConfig(lr=2.0, scheduler="wsd", warmup_steps=2, decay_ratio=0.25, min_lr_ratio=0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)
    scheduler = build_scheduler(optimizer, train, 20)  # decays over ceil(0.25 * 20) = the last 5 steps
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step(), scheduler.step()
    assert lrs[2:15] == [2.0] * 13
    expected = [2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 5))) for k in range(5)]
    assert lrs[15:] == pytest.approx(expected)
    assert [lr for lr in lrs[:2]] == pytest.approx([2.0 / 3, 4.0 / 3])


@pytest.mark.parametrize(("train", "message"), [
    ({"min_lr_ratio": 0.1}, "train.min_lr_ratio: train.scheduler constant has no decay to end at a floor "
                            "(linear, cosine and wsd have)"),
    ({"scheduler": "cosine", "decay_ratio": 0.2}, "train.decay_ratio: only the wsd schedule has a separate decay "
                                                  "phase (train.scheduler: cosine)"),
    ({"scheduler": "cosine", "min_lr_ratio": 1.0}, "train.min_lr_ratio: expected a number >= 0 and < 1"),
    ({"scheduler": "wsd", "decay_ratio": 0.0}, "train.decay_ratio: expected a number > 0 and < 1"),
])
def test_a_decay_setting_the_schedule_would_ignore_or_out_of_range_is_refused(train, message):
    with pytest.raises(ConfigError) as info:
        validate({**RUN, "train": train})
    assert str(info.value).startswith(f"config: {message}"), str(info.value)
