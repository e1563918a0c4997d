"""SFT's ``loss_type: dft`` (Dynamic Fine-Tuning, Wu et al. 2025; TRL's ``loss_type="dft"``): each labelled
token's ``-log p`` weighted by its probability ``p``, detached. On a real tiny model the loss and gradients equal
the paper's formula computed from full logits, padded, padding-free and packed alike and under the chunked
cross-entropy kernel; a run trains; a key of another method's vocabulary is refused."""

from __future__ import annotations

import math

import pytest
import torch
from run_support import assert_loss_kernel_keeps_the_step, compose_run, sft_config, write

from posttune.errors import ConfigError

TOL = 1e-6


@pytest.fixture
def llama_sft(llama_dpo):
    """posttune-llama, -sft and -memory (the fixture that registers them for preference tests)."""


def paper_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(DFT's loss, the cross-entropy) from the full logits of plain padded rows, no posttune loss code: the
    mean over labelled tokens of ``-sg(p) log p`` (the DFT paper's eq. 9), and of ``-log p``."""
    logits = model(batch["input_ids"]).float()
    labels = batch["labels"]
    mask = labels != -100
    logps = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(logps.detach().exp() * logps)[mask].sum() / mask.sum(), -logps[mask].mean()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("method", [{"padding_free": False}, {}, {"packing": True}], ids=["padded", "padding_free",
                                                                                       "packed"])
def test_the_loss_and_gradients_equal_the_papers_formula(llama_sft, tmp_path, method):
    session = compose_run(sft_config(tmp_path, rows=8, method={"name": "sft", "loss_type": "dft", **method}))
    batch = next(iter(session.train_data))
    out = session.plan.method.descriptor.loss(session, batch)
    (out.loss_sum / out.normaliser).backward()
    ours = gradients(session.model)
    assert int(out.normaliser) == int((batch["labels"] != -100).sum())

    # the same rows as padded rows (packed ones as padded rows of max_seq_len), for the plain forward
    reference_session = compose_run(sft_config(tmp_path / "padded", rows=8,
                                               method={"name": "sft", "padding_free": False,
                                                       "packing": method.get("packing", False)}))
    reference_session.model.load_state_dict(session.model.state_dict())
    reference, nll = paper_loss(reference_session.model, next(iter(reference_session.train_data)))
    reference.backward()
    theirs = gradients(reference_session.model)
    torch.testing.assert_close(out.loss_sum.detach() / out.normaliser, reference.detach(), atol=TOL, rtol=0)
    for name, grad in theirs.items():
        scale = max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(ours[name], grad, atol=2 * TOL * scale, rtol=0, msg=name)
    assert not math.isclose(float(reference.detach()), float(nll.detach()), abs_tol=1e-3)  # not the cross-entropy


def test_under_the_chunked_cross_entropy_kernel_the_loss_and_gradients_are_unchanged(llama_sft, tmp_path):
    assert_loss_kernel_keeps_the_step(
        lambda directory, memory: sft_config(directory, rows=8, memory=memory,
                                             method={"name": "sft", "loss_type": "dft"},
                                             memory_options={"chunked_cross_entropy": {"chunk_size": 7}} if memory
                                             else {}),
        tmp_path, "chunked_cross_entropy")


def test_a_dft_run_trains_and_an_unknown_loss_type_is_refused(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path, method={"name": "sft", "loss_type": "dft"}, train={"max_steps": 3})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    with pytest.raises(ConfigError, match="method.loss_type: expected one of 'nll', 'dft', got 'sigmoid'"):
        compose_run(sft_config(tmp_path / "bad", method={"name": "sft", "loss_type": "sigmoid"}))
