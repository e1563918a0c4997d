"""LoRA+ (``adapter.loraplus_lr_ratio``): the B matrices and DoRA's magnitudes learn at lr x ratio, grouped as
PEFT's ``create_loraplus_optimizer`` groups them, through the schedule, the per-parameter optimizers of
optimizer_in_backward, low-bit AdamW and a resume that changes ``train.lr``."""

from __future__ import annotations

import pytest
import torch
import transformers
from memory_support import compose_run, sft_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
import posttune_torchao
from posttune_lora.layer import apply_lora
from posttune.training.optim import param_groups, rescale_lr
from posttune.training.run_report import banner
from posttune.training.trainer import train

LR, RATIO = 1e-3, 16.0
TRAIN = {"max_steps": 2, "lr": LR, "weight_decay": 0.1, "scheduler": "cosine", "warmup_steps": 1}


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")
    register_plugin(posttune_torchao, distribution="posttune-torchao", version="0.1.0")


def shapes_by_lr(groups) -> dict[float, list[tuple[int, ...]]]:
    found: dict[float, list[tuple[int, ...]]] = {}
    for group in groups:
        found.setdefault(round(group["lr"], 12), []).extend(tuple(p.shape) for p in group["params"])
    return {lr: sorted(shapes) for lr, shapes in found.items()}


def test_the_groups_are_peft_s(plugins):
    """The same tiny Llama in transformers with PEFT's DoRA, and posttune's with its own: the same shapes at lr
    and at lr x ratio (B and the magnitudes), PEFT's grouping being the reference."""
    import peft
    from peft.optimizers import create_loraplus_optimizer
    from posttune_llama.model import build
    from posttune_llama.sizes import LLAMA_SIZES

    size = LLAMA_SIZES["tiny"]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=size["vocab_size"], hidden_size=size["hidden_size"], intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_layers"], num_attention_heads=size["num_heads"],
        num_key_value_heads=size["num_kv_heads"], head_dim=size["head_dim"]))
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    theirs = create_loraplus_optimizer(hf, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=RATIO)
    ours = build(**size)
    apply_lora(ours, targets=["layers.*.attn.q_proj", "layers.*.attn.v_proj", "layers.*.mlp.down_proj"],
                   rank=4, alpha=8, kind="dora")
    groups = [{"lr": LR, **group} for group in param_groups(ours.named_parameters(), 0.1, lora_plus=(LR, RATIO))]
    expected = shapes_by_lr(group for group in theirs.param_groups if group["params"])
    assert shapes_by_lr(groups) == expected and set(expected) == {LR, LR * RATIO}
    assert all(group["weight_decay"] == 0.0 for group in groups if group["params"][0].ndim == 1)


@pytest.mark.parametrize("memory", [[], ["adamw_8bit"]])
def test_the_ratio_holds_through_the_schedule(plugins, tmp_path, memory):
    session = compose_run(sft_config(tmp_path, train=TRAIN, memory=memory,
                                     adapter={"kind": "dora", "rank": 4, "alpha": 8, "loraplus_lr_ratio": RATIO,
                                              "rslora": True}))
    fast = [group for group in session.optimizer.param_groups if group["initial_lr"] == pytest.approx(LR * RATIO)]
    slow = [group for group in session.optimizer.param_groups if group["initial_lr"] == pytest.approx(LR)]
    assert len(fast) + len(slow) == len(session.optimizer.param_groups) and fast and slow
    names = {id(p): n for n, p in session.trainable.named_parameters()}
    assert {names[id(p)].split(".")[-2 if p.ndim > 1 else -1] for g in fast for p in g["params"]} == {
        "lora_B", "magnitude"}
    assert {names[id(p)].split(".")[-2] for g in slow for p in g["params"]} == {"lora_A"}
    assert banner(session)[0].endswith(", dora rank 4 alpha 8, rsLoRA, LoRA+ ratio 16")  # what the run prints
    train(session)  # past warmup, into the cosine: every group's lr keeps its ratio to the first's
    rescale_lr(session.optimizer, session.scheduler, 0.5)  # what a resume with half the train.lr does
    for group in fast:
        assert float(group["lr"]) == pytest.approx(RATIO * float(slow[0]["lr"]), rel=1e-6)
        assert float(group["initial_lr"]) == pytest.approx(RATIO * LR / 2, rel=1e-6)


def test_optimizer_in_backward_steps_each_parameter_at_its_group_s_rate(plugins, tmp_path):
    """One step of SGD without momentum: each adapter weight moves by its lr x its gradient, B at 16x A's rate,
    the same with the per-parameter optimizers as with the normal loop."""
    steps = {**TRAIN, "optimizer": "sgd", "max_steps": 1, "warmup_steps": 0, "weight_decay": 0.0,
             "max_grad_norm": None, "scheduler": "constant"}
    moved = {}
    for memory in ([], ["optimizer_in_backward"]):
        session = compose_run(sft_config(tmp_path / str(len(memory)), train=steps, memory=memory,
                                         adapter={"rank": 4, "alpha": 8, "loraplus_lr_ratio": RATIO}))
        first_b = next(p for n, p in session.trainable.named_parameters() if "lora_B" in n)
        torch.nn.init.normal_(first_b, generator=torch.Generator().manual_seed(0))  # else A gets no gradient
        before = {n: p.detach().clone() for n, p in session.trainable.named_parameters() if p.requires_grad}
        train(session)
        moved[len(memory)] = {n: before[n] - p.detach() for n, p in session.trainable.named_parameters()
                              if p.requires_grad}
    for name, delta in moved[0].items():
        torch.testing.assert_close(moved[1][name], delta, atol=1e-7, rtol=0, msg=name)
