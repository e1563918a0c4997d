"""optimizer_in_backward: the same parameters as the normal loop, exact resume, refusals."""

from __future__ import annotations

import pytest
import torch
import yaml
from memory_support import compose_run, sft_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
from posttune.training.metrics import read_metrics
from posttune.training.trainer import train

#: cosine schedule with warmup, weight decay on matrices: the per-parameter optimizers must follow both
TRAIN = {"max_steps": 3, "max_grad_norm": None, "scheduler": "cosine", "warmup_steps": 1, "weight_decay": 0.1}


@pytest.fixture
def llama_sft(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")


def trained(config: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    session = compose_run(config)
    train(session)
    params = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    return params, read_metrics(session.config.checkpoint.output_dir)


def test_three_steps_give_the_parameters_of_the_normal_loop(llama_sft, tmp_path):
    normal, normal_log = trained(sft_config(tmp_path / "a", train=TRAIN))
    in_backward, log = trained(sft_config(tmp_path / "b", train=TRAIN, memory=["optimizer_in_backward"]))
    for name, param in normal.items():
        torch.testing.assert_close(in_backward[name], param, atol=1e-6, rtol=0, msg=name)
    for ours, theirs in zip(log, normal_log, strict=True):
        assert ours["lr"] == pytest.approx(theirs["lr"])
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


def test_gradients_are_freed_during_backward(llama_sft, tmp_path):
    session = compose_run(sft_config(tmp_path, train=TRAIN, memory=["optimizer_in_backward"]))
    before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    batch = next(iter(session.train_data))
    session.plan.method.descriptor.loss(session, batch).loss_sum.backward()
    assert all(p.grad is None for p in session.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in session.model.named_parameters())


def test_resume_continues_exactly(llama_sft, tmp_path):
    steps = {**TRAIN, "max_steps": 4}
    whole, _ = trained(sft_config(tmp_path / "whole", train=steps, memory=["optimizer_in_backward"],
                                  checkpoint={"save_every": 2}))
    saved = tmp_path / "whole" / "out" / "checkpoints" / "step-00000002"
    assert (saved / "optimizer.pt").is_file()
    resumed, _ = trained(sft_config(tmp_path / "resumed", train=steps, memory=["optimizer_in_backward"],
                                    checkpoint={"resume": str(saved)}))
    for name, param in whole.items():
        torch.testing.assert_close(resumed[name], param, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize(("override", "field"), [
    ({"grad_accum_steps": 2, "max_grad_norm": None}, "train.grad_accum_steps"),
    ({"max_grad_norm": 1.0}, "train.max_grad_norm"),
])
def test_accumulation_and_clipping_are_refused_before_launch(llama_sft, posttune_cli, tmp_path, override, field):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path, train=override, memory=["optimizer_in_backward"])))
    result = posttune_cli("validate", str(path))
    assert result.exit_code != 0
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and field in message[0] and "optimizer_in_backward" in message[0]
