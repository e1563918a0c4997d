"""The plain losses put only labelled positions through the head (``logits_at``), with the numbers
and gradients of the full ``[batch, seq, vocab]`` computation; a model without the option gets the
full logits as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttune.losses import IGNORE_INDEX, token_cross_entropy, token_logps
from test_decoder_options import VOCAB, decoder, tokens


def batch(*, documents: bool = False) -> dict[str, torch.Tensor]:
    """Two rows of 12: a 5-token prompt (ignored), 6 labelled tokens, one ignored pad at the end."""
    input_ids = tokens(2, 12, seed=1)
    labels = tokens(2, 12, seed=2)
    labels[:, :5] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    out = {"input_ids": input_ids, "labels": labels}
    if documents:  # row 0 holds two documents of 6
        out["document_ids"] = torch.tensor([[0] * 6 + [1] * 6, [0] * 12])
    return out


def full_logps(model: nn.Module, data: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The textbook computation: every position's logits, log-softmax, the label's entry, 0 where ignored."""
    logits = model(data["input_ids"], document_ids=data.get("document_ids")) / temperature
    labels = data["labels"]
    picked = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return picked * (labels != IGNORE_INDEX)


def head_rows(model: nn.Module) -> list[int]:
    seen: list[int] = []
    model.output.register_forward_hook(lambda _m, args, _out: seen.append(args[0].flatten(0, -2).shape[0]))
    return seen


@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("cap", [None, 5.0], ids=["plain", "softcap"])
def test_token_logps_match_the_full_logits_and_the_head_sees_labelled_rows_only(documents, cap):
    model, reference = decoder(logit_cap=cap), decoder(logit_cap=cap)
    data = batch(documents=documents)
    seen = head_rows(model)
    values = token_logps(SimpleNamespace(model=model), data, temperature=0.7)
    assert seen == [int((data["labels"] != IGNORE_INDEX).sum())] == [12]
    expected = full_logps(reference, data, temperature=0.7)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-5)
    assert values[data["labels"] == IGNORE_INDEX].eq(0).all()

    values.sum().backward()
    expected.sum().backward()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_token_cross_entropy_is_the_summed_full_loss_with_the_same_gradients():
    model, reference = decoder(), decoder()
    data = batch()
    loss, count = token_cross_entropy(SimpleNamespace(model=model), data)
    logits = reference(data["input_ids"])
    expected = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    assert int(count) == 12
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)
    loss.backward()
    expected.backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_nothing_labelled_gives_zero_and_the_head_gets_no_rows():
    model = decoder()
    data = batch()
    data["labels"][:] = IGNORE_INDEX
    seen = head_rows(model)
    loss, count = token_cross_entropy(SimpleNamespace(model=model), data)
    assert seen == [0] and float(loss.detach()) == 0.0 and int(count) == 0
    assert token_logps(SimpleNamespace(model=model), data).eq(0).all()


class Wrapped(nn.Module):
    """A model whose forward has no ``logits_at`` (another family's contract): full logits come back."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, *, document_ids=None, positions=None) -> torch.Tensor:
        return self.inner(input_ids, document_ids=document_ids, positions=positions)


def test_a_model_without_logits_at_gets_the_full_logits():
    model = Wrapped(decoder())
    data = batch()
    seen = head_rows(model.inner)
    values = token_logps(SimpleNamespace(model=model), data)
    assert seen == [2 * 12]  # every position went through the head
    torch.testing.assert_close(values, full_logps(decoder(), data), rtol=0, atol=1e-5)
    assert logits_shape(model, data) == (2, 12, VOCAB)


def logits_shape(model: nn.Module, data: dict[str, torch.Tensor]) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(model(data["input_ids"]).shape)


def full_entropies(model: nn.Module, data: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """Every position's entropy by torch.distributions (not posttune's formula), 0 where the label is ignored."""
    logits = model(data["input_ids"], document_ids=data.get("document_ids")).float() / temperature
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    return entropy * (data["labels"] != IGNORE_INDEX)


@pytest.mark.parametrize("wrapped", [False, True], ids=["labelled_rows", "full_logits"])
@pytest.mark.parametrize("cap", [None, 5.0], ids=["plain", "softcap"])
def test_entropies_come_with_the_same_logps_from_one_forward(wrapped, cap):
    inner, reference = decoder(logit_cap=cap), decoder(logit_cap=cap)
    model = Wrapped(inner) if wrapped else inner
    data = batch(documents=True)
    seen = head_rows(inner)
    logps, entropies = token_logps(SimpleNamespace(model=model), data, temperature=0.7, entropies=True)
    assert len(seen) == 1  # one forward for both
    torch.testing.assert_close(logps, full_logps(reference, data, temperature=0.7), rtol=0, atol=1e-5)
    with torch.no_grad():
        expected = full_entropies(reference, data, temperature=0.7)
    torch.testing.assert_close(entropies, expected, rtol=0, atol=1e-5)
    labelled = data["labels"] != IGNORE_INDEX
    assert entropies[~labelled].eq(0).all() and entropies[labelled].gt(0).all()
    assert logps.requires_grad and not entropies.requires_grad  # a mask is chosen with them, not trained
