"""PPO's padding-free learner (``method.padding_free``, ``method.share_prompt``, the defaults): a micro-batch's
rows end to end as documents, each group's prompt once, give the padded rows' log-probs, values, loss,
metrics and gradients, with a value model of its own and with a value head on the policy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from run_support import assert_same_step, compose_run
from test_ppo import PPO, ppo_config

LAYOUTS = {"padded": {"padding_free": False}, "whole": {"share_prompt": False}, "shared": {}}


@pytest.mark.parametrize("value_model", ["model", "head"])
def test_the_padding_free_learner_gives_the_padded_rows_values_loss_and_gradients(tmp_path, value_model):
    from posttune_ppo.experience import completion_mask, logps_and_values
    from posttune_ppo.method import batches

    session = compose_run(ppo_config(tmp_path, method={**PPO, "group_size": 4, "value_model": value_model,
                                                       "temperature": 0.7}))
    batch = next(iter(batches(session)))
    config = session.method_config
    assert config.padding_free and config.share_prompt  # the defaults
    mask = completion_mask(batch)
    assert mask.any() and bool((batch["prompt_lengths"] > batch["lengths"]).all())
    results = {}
    for name, layout in LAYOUTS.items():
        session.method_config = dataclasses.replace(config, **{"padding_free": True, "share_prompt": True, **layout})
        with torch.no_grad():
            logps, values = logps_and_values(session, batch)
        session.trainable.zero_grad(set_to_none=True)
        out = session.plan.method.descriptor.loss(session, batch)
        (out.loss_sum / out.normaliser).backward()
        grads = {n: p.grad.clone() for n, p in session.trainable.named_parameters() if p.grad is not None}
        results[name] = (logps, values, out, grads)
    padded_logps, padded_values, padded, padded_grads = results["padded"]
    assert len(padded_grads) == len([p for p in session.trainable.parameters() if p.requires_grad])
    for name in ("whole", "shared"):
        logps, values, out, grads = results[name]
        torch.testing.assert_close(logps[mask], padded_logps[mask], rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(values[mask], padded_values[mask], rtol=0, atol=1e-5, msg=name)
        assert_same_step((out, grads), (padded, padded_grads), loss_atol=1e-5, msg=name)


def test_the_learner_forward_holds_each_prompt_once(tmp_path):
    from posttune_ppo.method import batches

    session = compose_run(ppo_config(tmp_path, method={**PPO, "group_size": 4, "value_model": "head"}))
    batch = next(iter(batches(session)))
    widths = []
    session.model.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape))
    session.plan.method.descriptor.loss(session, batch)
    rows = batch["input_ids"].shape[0]
    real = batch["prompt_lengths"] + batch["lengths"]
    # rows of one prompt come in groups; each row after the first of its group skips the prompt
    shared = sum(int(batch["prompt_lengths"][r]) - 1 for r in range(1, rows)
                 if torch.equal(batch["input_ids"][r, :batch["prompt_lengths"][r]],
                                batch["input_ids"][r - 1, :batch["prompt_lengths"][r]]))
    assert shared > 0
    assert widths == [torch.Size([1, int(real.sum()) - shared])]
