"""What an optimizer step does with the gradients and the rates the config gives it: weight decay on matrices
only, `train.max_grad_norm` clipping (against torch's `clip_grad_norm_` on the same gradients), and a resume
that changes `train.lr` (every later step at the new rate, not only the first)."""

from __future__ import annotations

import json

import torch
import yaml

from posttune.training.trainer import train
from run_support import compose_run, sft_config


def test_weight_decay_applies_to_matrices_only(llama_sft, tmp_path):
    session = compose_run(sft_config(tmp_path, train={"weight_decay": 0.1, "max_steps": 1}))
    decay = {id(p): group["weight_decay"] for group in session.optimizer.param_groups for p in group["params"]}
    params = [p for p in session.model.parameters() if p.requires_grad]
    assert len(decay) == len(params) and {p.ndim for p in params} == {1, 2}  # norm scales and matrices
    assert all(decay[id(p)] == (0.1 if p.ndim >= 2 else 0.0) for p in params)


def one_sgd_step(tmp_path, max_grad_norm):
    """The update one SGD step at lr 1 makes (``-`` the gradient as applied), and the step's logged grad_norm."""
    session = compose_run(sft_config(tmp_path, train={"optimizer": "sgd", "lr": 1.0, "weight_decay": 0.0,
                                                      "max_grad_norm": max_grad_norm, "max_steps": 1,
                                                      "scheduler": "constant", "warmup_steps": 0}))
    before = [p.detach().clone() for p in session.model.parameters()]
    train(session)
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    return [p.detach() - b for p, b in zip(session.model.parameters(), before)], record["grad_norm"]


def test_max_grad_norm_clips_as_torch_clip_grad_norm(llama_sft, tmp_path):
    free, free_norm = one_sgd_step(tmp_path / "free", None)
    max_norm = free_norm / 4
    clipped, logged = one_sgd_step(tmp_path / "clipped", max_norm)
    assert logged == free_norm  # the norm before clipping is what is logged
    expected = [g.clone() for g in free]
    for tensor, g in zip(expected, free):
        tensor.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(expected, max_norm)  # the reference: torch's clip of the unclipped step's gradient
    for got, reference in zip(clipped, expected):  # an update read back as weights after - before: fp32 rounding
        torch.testing.assert_close(got, reference.grad, rtol=1e-3, atol=1e-6)
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped])))
    assert abs(norm - max_norm) < 1e-3 * max_norm


def test_a_resume_with_a_new_lr_trains_every_later_step_at_it(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path, train={"max_steps": 5, "lr": 1e-3, "scheduler": "constant", "warmup_steps": 0},
                        checkpoint={"save_every": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert posttune_cli("train", str(path), "train.max_steps=2").exit_code == 0
    resumed = posttune_cli("train", str(path), "train.lr=5e-4", "checkpoint.resume=latest")
    assert resumed.exit_code == 0, resumed.stderr
    rates = [json.loads(line)["lr"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rates == [1e-3, 1e-3, 5e-4, 5e-4, 5e-4]
