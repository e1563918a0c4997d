"""posttune-torchao's techniques against torchao's own reference configurations and the core's optimizer: NF4 in the
QLoRA paper's layout (blocks of 64, double-quantised scales), QAT's fake quantisation and export as torchao's
`QATConfig` makes them, the int4 export's default group, and the low-bit AdamWs' weight-decay groups."""

from __future__ import annotations

import copy

import pytest
import torch
from memory_support import compose_run, sft_config
from torch import nn

import posttune_llama
import posttune_sft
import posttune_torchao

pytest.importorskip("torchao")


class Layers(nn.Module):
    """What the techniques look for: linear layers under ``model.layers``."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width_in, width_out, bias=False))])


def test_nf4_weights_are_torchaos_to_nf4_in_qloras_blocks_of_64():
    from torchao.quantization import to_nf4

    from posttune_torchao.qlora import quantize_frozen_linears

    torch.manual_seed(0)
    model = Layers(256, 256).requires_grad_(False)
    dense = model.layers[0][0].weight.detach().clone()
    quantize_frozen_linears(model)
    ours, reference = model.layers[0][0].weight, to_nf4(dense, 64, 256)
    assert (ours.block_size, ours.scaler_block_size) == (64, 256)
    assert torch.equal(ours.get_original_weight(), reference.get_original_weight())


@pytest.mark.parametrize("scheme", ["8da4w", "4w"])
def test_qat_fake_quantises_and_exports_as_torchaos_qat_config(scheme):
    """torchao's ``QATConfig`` of the same base config (int4 symmetric weights in groups of 32; with ``8da4w``,
    int8 per-token asymmetric activations) is the reference: the fake-quantised forward and the exported grid."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, PerGroup, quantize_
    from torchao.quantization.qat import QATConfig

    from posttune_torchao.qat import convert, prepare

    torch.manual_seed(0)
    model, x = Layers(64, 32), torch.randn(4, 64)
    reference = nn.Sequential(copy.deepcopy(model.layers[0][0]))
    base = (Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
            if scheme == "8da4w" else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    quantize_(reference, QATConfig(base, step="prepare"))
    prepare(model, scheme, 32)
    torch.testing.assert_close(model.layers[0][0](x), reference(x), rtol=0, atol=0)
    convert(model)
    grid = reference[0].weight_fake_quantizer(reference[0].weight).detach()
    torch.testing.assert_close(model.layers[0][0].weight.detach(), grid, rtol=0, atol=0)


def test_the_int4_export_groups_128_weights_by_default():
    """torchao's and the published int4 checkpoints' group size, when ``--group-size`` is left out."""
    from posttune_torchao.quantize import quant_config

    assert quant_config("int4_weight_only", None, "cpu").granularity.group_size == 128


@pytest.mark.parametrize("technique", ["adamw_8bit", "adamw_4bit"])
def test_low_bit_adamw_keeps_the_cores_weight_decay_groups(register_plugin, tmp_path, technique):
    """``train.weight_decay`` on matrices, none on norms and biases, as the core's AdamW (not torchao's 0.01)."""
    for module, name in ((posttune_llama, "posttune-llama"), (posttune_sft, "posttune-sft"),
                         (posttune_torchao, "posttune-torchao")):
        register_plugin(module, distribution=name, version="0.1.0")
    train = {"max_steps": 1, "weight_decay": 0.1}
    core = compose_run(sft_config(tmp_path / "core", train=train))
    low = compose_run(sft_config(tmp_path / "low", train=train, memory=[technique]))
    assert type(low.optimizer).__name__ != type(core.optimizer).__name__

    def groups(optimizer):
        return [(group["weight_decay"], len(group["params"])) for group in optimizer.param_groups]

    assert groups(low.optimizer) == groups(core.optimizer) == [(0.1, groups(core.optimizer)[0][1]),
                                                               (0.0, groups(core.optimizer)[1][1])]
