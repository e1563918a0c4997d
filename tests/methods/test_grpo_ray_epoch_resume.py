"""GRPO's Ray rollout source resumed from a checkpoint taken just before an epoch boundary: the hand-outs ran
ahead of training and drew the epoch's last prompt batch, so the loader had already moved itself on to the next
epoch while the trainer's ``epoch`` had not. The resumed run must label its steps, and hand out its batches, with
the uninterrupted run's epochs (a user trial: every step after the resume logged ``epoch 0``).

The source runs here with a stand-in for its actor pool (every batch scored at once) and the core's real
``BatchLoader`` inside GRPO's ``RolloutLoader``; the loop below keeps the epoch as the trainer does
(docs/architecture.md, "The trainer loop"): no Ray, no model, well under a second.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from posttune.data.loader import BatchLoader
from posttune_grpo import ray_actors
from posttune_grpo.method import RolloutLoader
from posttune_grpo.ray_actors import Handout, RaySource

PROMPTS, BATCH = 16, 2  # 8 prompt batches (and optimizer steps) an epoch
STEPS = 12
BOUND = 2  # off_policy's default staleness: the queue runs 2 batches ahead of training


class ScoredAtOnce:
    """The actor pool's interface, each batch "scored" as soon as it is submitted: its hand-out epoch and rows."""

    def __init__(self, version: int):
        self.version, self.dropped = version, 0

    def submit(self, handout: Handout) -> None:
        handout.result = {"epoch": handout.epoch, "rows": list(handout.prompts["rows"])}

    def ready(self, handouts: Any) -> int:
        return sum(h.result is not None for h in handouts)

    def result(self, handout: Handout) -> dict[str, Any]:
        return handout.result


def prompt_batches(share: list[int]) -> dict[str, Any]:
    """A prompt batch as the prompt loader collates one (what ``ray_actors.portable`` reads)."""
    return {"prompt_ids": [torch.tensor([row]) for row in share], "prompts": [f"prompt {row}" for row in share],
            "fields": {}, "rows": torch.tensor(share)}


def session() -> SimpleNamespace:
    loader = BatchLoader(collate=prompt_batches, batch_size=BATCH, num_items=PROMPTS, get_item=lambda i: i)
    return SimpleNamespace(step=0, epoch=0, train_data=RolloutLoader(loader, 1))


def source(version: int) -> RaySource:
    options = SimpleNamespace(queue_size=4, sync_every=1)
    return RaySource(options, bound=BOUND, steps_per_batch=1, pool=ScoredAtOnce(version))


def train(run: SimpleNamespace, rollouts: RaySource, *, save_at: int | None = None) -> tuple[list[tuple], dict]:
    """(step, the step's epoch, its batch's hand-out epoch, its rows) per step, and the checkpoint at ``save_at``:
    the trainer's epoch bookkeeping (``session.epoch += 1``, ``set_epoch``) around the source's batches."""
    steps, saved = [], {}
    while run.step < STEPS:
        for batch in rollouts.rollouts(run):
            run.step += 1
            rollouts.pool.version = run.step  # the push of after_step (sync_every 1)
            steps.append((run.step, run.epoch, batch["epoch"], tuple(batch["rows"])))
            if run.step == save_at:
                saved = checkpoint(run, rollouts)
            if run.step >= STEPS:
                break
        else:
            run.epoch += 1
            run.train_data.set_epoch(run.epoch)
    return steps, saved


def checkpoint(run: SimpleNamespace, rollouts: RaySource) -> dict[str, Any]:
    """What a checkpoint keeps of the data and the source, written and read back as the core does."""
    buffer = io.BytesIO()
    torch.save(rollouts.state_dict(), buffer)
    buffer.seek(0)
    return {"step": run.step, "epoch": run.epoch, "data": json.loads(json.dumps(run.train_data.state_dict())),
            "handed_out": torch.load(buffer, weights_only=True)}


@pytest.fixture(autouse=True)
def arrive_as_scored(monkeypatch):
    """The learner's part of an arrival (its log-probs, the step's figures) needs a model: the result as it came."""
    monkeypatch.setattr(ray_actors.RaySource, "_arrived", lambda self, session, result: result)


@pytest.mark.parametrize("save_at", [7, 8, 5])
def test_a_resume_near_the_epoch_end_continues_the_uninterrupted_runs_epochs(save_at):
    """Saved at step 7 (and at step 8, the epoch's last, which leaves no hand-out behind) the loader is already at
    epoch 1; the resumed run trains the restored batch in epoch 0 and then epoch 1, step for step as the
    uninterrupted run, whose rows it also hands out (epoch 1's, once). Step 5: the loader still in epoch 0."""
    expected, saved = train(session(), source(version=0), save_at=save_at)
    assert [epoch for _, epoch, _, _ in expected] == [0] * 8 + [1] * 4
    assert [handed for _, epoch, handed, _ in expected] == [epoch for _, epoch, _, _ in expected]
    if save_at >= 7:
        assert saved["data"]["epoch"] == 1 and saved["epoch"] == 0  # the hand-outs ran past the epoch's end

    resumed = session()
    resumed.train_data.load_state_dict(saved["data"])
    resumed.step, resumed.epoch = saved["step"], saved["epoch"]
    rollouts = source(version=saved["step"])
    rollouts.load_state_dict(saved["handed_out"])
    got, _ = train(resumed, rollouts)

    assert got == expected[save_at:]
    assert resumed.train_data.epoch == 1  # the trainer's set_epoch(1) at the epoch's end did not rewind it
