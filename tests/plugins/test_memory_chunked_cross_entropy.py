"""chunked_cross_entropy: the same loss and gradients as the plain loss, without full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from memory_support import batch, fake_session, grads, tiny_llama, twin

from posttune_lora.layer import apply_lora
from posttune.errors import PosttuneError
from posttune.losses import token_cross_entropy, token_logps
from posttune_memory import ChunkedCrossEntropyConfig
from posttune_memory import linear_cross_entropy as lce


def reference(hidden, weight, targets, bias=None, softcap=None):
    """The textbook loss: full logits, optional soft-cap, summed cross-entropy."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, reduction="sum")


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [7, 64])
def test_linear_cross_entropy_matches_the_full_logits_formula(softcap, with_bias, chunk_size):
    torch.manual_seed(0)
    leaves = [torch.randn(37, 16), torch.randn(50, 16), torch.randn(50) if with_bias else None]
    targets = torch.randint(0, 50, (37,))
    ours = [t.clone().requires_grad_() if t is not None else None for t in leaves]
    ref = [t.clone().requires_grad_() if t is not None else None for t in leaves]
    loss = lce.linear_cross_entropy(ours[0], ours[1], targets, bias=ours[2], softcap=softcap, chunk_size=chunk_size)
    expected = reference(ref[0], ref[1], targets, ref[2], softcap)
    (0.25 * loss).backward()
    (0.25 * expected).backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-6)
    for mine, theirs in zip(ours, ref, strict=True):
        if mine is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=0)


def chunked(model: torch.nn.Module, chunk_size: int = 5):
    session = fake_session(model, chunked_cross_entropy=ChunkedCrossEntropyConfig(chunk_size=chunk_size))
    lce.apply(session, session.target)
    return session


def assert_same_step(plain: torch.nn.Module, ours: torch.nn.Module) -> None:
    loss, count = token_cross_entropy(fake_session(plain), batch())
    loss.backward()
    loss_chunked, count_chunked = token_cross_entropy(chunked(ours), batch())
    loss_chunked.backward()
    assert int(count_chunked) == int(count) == 2 * 24 - 4 - 7
    torch.testing.assert_close(loss_chunked, loss.detach(), atol=1e-5, rtol=1e-6)
    expected, got = grads(plain), grads(ours)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)


def test_chunked_loss_matches_the_plain_loss_on_a_model():
    plain = tiny_llama()
    assert_same_step(plain, twin(plain))


def test_chunked_loss_matches_with_tied_embeddings():
    plain = tiny_llama(tie_word_embeddings=True)
    assert plain.output.weight is plain.embed.weight
    ours = twin(plain)
    assert ours.output.weight is ours.embed.weight
    assert_same_step(plain, ours)


def test_chunked_loss_applies_the_models_logit_softcap_per_chunk():
    plain = tiny_llama()
    plain.logit_softcap = 0.05  # small enough to bend these logits
    assert_same_step(plain, twin(plain))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_chunked_loss_matches_with_an_adapted_output_head(kind):
    plain = tiny_llama()
    apply_lora(plain, targets=["output", "q_proj"], rank=4, alpha=8, kind=kind)
    with torch.no_grad():  # a trained adapter: B = 0 would hide a wrong formula
        for name, param in plain.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.05)
    assert_same_step(plain, twin(plain))


@pytest.mark.parametrize("cap", [None, 0.05], ids=["plain", "softcap"])
def test_chunked_logps_and_entropies_match_the_plain_path_and_train_the_same(cap):
    plain = tiny_llama()
    plain.logit_softcap = cap
    ours = twin(plain)
    want = token_logps(fake_session(plain), batch(), temperature=0.7, entropies=True)
    got = token_logps(chunked(ours), batch(), temperature=0.7, entropies=True)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), atol=1e-5, rtol=1e-6)
    assert got[1].gt(0).sum() == 2 * 24 - 4 - 7 and not got[1].requires_grad
    weights = want[1] / want[1].max()  # rows weighed by entropy, as a mask chosen from them does
    (want[0] * weights).sum().backward()
    (got[0] * weights).sum().backward()
    expected, mine = grads(plain), grads(ours)
    for name, grad in expected.items():
        torch.testing.assert_close(mine[name], grad, atol=1e-5, rtol=0, msg=name)


def test_adapter_dropout_on_the_head_is_refused():
    model = tiny_llama()
    apply_lora(model, targets=["output"], rank=4, alpha=8, dropout=0.1)
    with pytest.raises(PosttuneError, match="adapter.dropout"):
        chunked(model)


def test_a_sharded_head_is_refused_pointing_to_a_parallel_loss(monkeypatch):
    monkeypatch.setattr(lce, "is_dtensor", lambda tensor: True)
    with pytest.raises(PosttuneError, match="use a plan that parallelises the loss"):
        chunked(tiny_llama())
