"""activation_checkpointing: same gradients, recomputed layers, unchanged parameter names."""

from __future__ import annotations

import pytest
import torch
from memory_support import batch, fake_session, grads, tiny_llama, twin

from posttune.losses import token_cross_entropy
from posttune_memory import CheckpointingConfig
from posttune_memory.checkpointing import apply


def step_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, _ = token_cross_entropy(fake_session(model), batch())
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("every", [1, 2])
def test_checkpointed_layers_give_the_same_loss_and_gradients(every):
    plain = tiny_llama(num_layers=3)
    checkpointed = twin(plain)
    session = fake_session(checkpointed, activation_checkpointing=CheckpointingConfig(every=every))
    apply(session, session.target)
    wrapped = [getattr(layer, "activation_checkpointed", False) for layer in checkpointed.layers]
    assert wrapped == ([True, True, True] if every == 1 else [False, True, False])
    loss, expected = step_grads(plain)
    loss_ckpt, got = step_grads(checkpointed)
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=0)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)


def test_a_checkpointed_layer_runs_its_forward_again_in_backward():
    model = tiny_llama()
    session = fake_session(model, activation_checkpointing=CheckpointingConfig())
    apply(session, session.target)
    calls = []
    # a pre-hook: recomputation stops early once the last saved tensor is rebuilt, before the MLP returns
    model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    loss, _ = token_cross_entropy(fake_session(model), batch())
    assert len(calls) == 1
    loss.backward()
    assert len(calls) == 2  # recomputed during backward


def test_checkpointing_keeps_parameter_names_and_skips_recompute_without_grad():
    model = tiny_llama()
    names = list(model.state_dict())
    session = fake_session(model, activation_checkpointing=CheckpointingConfig())
    apply(session, session.target)
    assert list(model.state_dict()) == names
    with torch.no_grad():
        logits = model(batch()["input_ids"])
    assert logits.shape[-1] == 512
