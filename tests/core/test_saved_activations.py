"""RMSNorm and the gated MLP keep only their inputs for the backward and give autograd's gradients exactly.

The plain expressions (`rms_norm`, ``act(gate) * up``) are the reference: the same outputs and bitwise the
same gradients, whichever of input and weight is trainable (full training, LoRA's frozen base, a frozen
first layer), in fp32 and bf16; and fewer bytes saved for the backward, which is what they are for.
"""

from __future__ import annotations

import pytest
import torch

from posttune.modules import GatedMLP, RMSNorm
from posttune.modules.mlp import ACTIVATIONS, gated_product
from posttune.modules.rmsnorm import rms_norm


def saved_bytes(run) -> tuple[torch.Tensor, int]:
    """``run()``'s output and the bytes saved for the backward while it builds its graph, once per storage."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, sum(storages.values())


def grads_of(out: torch.Tensor, tensors: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor | None]:
    trainable = [t for t in tensors if t.requires_grad]
    found = iter(torch.autograd.grad(out, trainable, grad))
    return [next(found) if t.requires_grad else None for t in tensors]


def assert_same_grads(out: torch.Tensor, plain: torch.Tensor, tensors: list[torch.Tensor], grad: torch.Tensor) -> None:
    """The gradients of ``out`` and of the plain expression's ``plain``: the same ones asked for, bitwise equal."""
    for got, want in zip(grads_of(out, tensors, grad), grads_of(plain, tensors, grad), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("trainable", ["both", "input", "weight"])
def test_rmsnorm_gives_autograds_gradients_and_saves_only_its_input(dtype, offset, trainable):
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5, offset=offset).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    norm.weight.requires_grad_(trainable != "input")
    x = torch.randn(3, 10, 64, dtype=dtype).requires_grad_(trainable != "weight")
    grad = torch.randn(3, 10, 64, dtype=dtype)

    out, saved = saved_bytes(lambda: norm(x))
    plain, plain_saved = saved_bytes(lambda: rms_norm(x, norm.weight, norm.eps, offset))

    assert torch.equal(out, plain)
    assert_same_grads(out, plain, [x, norm.weight], grad)
    if x.requires_grad:
        assert saved <= x.nbytes + norm.weight.nbytes  # the input (and the weight, when it trains)
        assert saved < plain_saved
    else:  # the plain expression keeps the normalised rows alone: nothing to save
        assert saved == plain_saved


def test_rmsnorm_saves_nothing_without_gradients_and_matches_in_eval():
    norm = RMSNorm(16)
    x = torch.randn(2, 16)
    with torch.no_grad():
        out, saved = saved_bytes(lambda: norm(x))
    assert saved == 0
    assert torch.equal(out, rms_norm(x, norm.weight, norm.eps, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_product_gives_autograds_gradients_and_drops_the_activation(dtype, activation):
    torch.manual_seed(0)
    gate = torch.randn(7, 48, dtype=dtype, requires_grad=True)
    up = torch.randn(7, 48, dtype=dtype, requires_grad=True)
    grad = torch.randn(7, 48, dtype=dtype)

    out, saved = saved_bytes(lambda: gated_product(gate, up, activation))
    plain, plain_saved = saved_bytes(lambda: ACTIVATIONS[activation](gate) * up)

    assert torch.equal(out, plain)
    assert_same_grads(out, plain, [gate, up], grad)  # both trainable: neither gradient is None
    assert saved == gate.nbytes + up.nbytes
    assert plain_saved == 3 * gate.nbytes  # gate, act(gate) and up


def test_gated_mlp_with_a_frozen_side_and_its_parameters_gradients():
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, activation="silu")
    mlp.up_proj.weight.requires_grad_(False)  # one side frozen: only the other's gradient is asked for
    x = torch.randn(5, 32, requires_grad=True)
    out = mlp(x)
    plain = mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x))
    tensors = [x, *mlp.parameters()]
    grad = torch.randn_like(out)
    assert_same_grads(out, plain, tensors, grad)
