"""Shared prefixes in packed rows: a document whose explicit positions start at ``p > 0`` continues
the first ``p`` tokens of its root (the last earlier document starting at 0), as DPO's pairs share a
prompt. Pinned to the definition: each continuation's logits and the gradients equal running the
prefix written out in front of it, alone (fp32, 1e-5), for GQA, sliding windows and soft-caps;
bad layouts are refused in one line; padding a shared row keeps its tail a document of its own.
"""

from __future__ import annotations

import pytest
import torch
from test_packed_attention import TOLERANCE, VOCAB, decoder, gradients, loss

from posttune.modules.attention import document_spans
from posttune.training.distributed import padded_sequence

# (first position, length) per document of one row: a root of 9, two continuations of its first 6
# tokens, a document of its own, a continuation of that one's first 2, and a 2-token tail
DOCUMENTS = ((0, 9), (6, 5), (6, 4), (0, 3), (2, 2), (0, 2))


def shared_row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, document ids and positions [1, 25] of ``DOCUMENTS``."""
    total = sum(length for _, length in DOCUMENTS)
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(seed))
    documents = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(DOCUMENTS)])[None]
    positions = torch.cat([torch.arange(start, start + n) for start, n in DOCUMENTS])[None]
    return ids, documents, positions


def written_out(ids: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Per document: its tokens with its root's prefix written out in front, and the prefix length."""
    out, root, begin = [], None, 0
    for start, length in DOCUMENTS:
        own = ids[0, begin:begin + length]
        if start == 0:
            root = own
        out.append((torch.cat([root[:start], own]), start))
        begin += length
    return out


@pytest.mark.parametrize("options", [{}, {"kv_heads": 4, "bias": True}, {"window": 4}, {"window": 30},
                                     {"softcap": 0.5}, {"softcap": 0.5, "window": 5}],
                         ids=["gqa", "mha_bias", "window_binds", "window_wider", "softcap", "softcap_window"])
def test_a_continuation_sees_exactly_its_written_out_prefix(options):
    model = decoder(**options)
    ids, documents, positions = shared_row()
    shared = model(ids, document_ids=documents, positions=positions)
    loss(shared).backward()
    shared_grads = gradients(model)
    alone, alone_loss = [], 0.0
    for tokens, prefix in written_out(ids):
        logits = model(tokens[None])[:, prefix:]  # the prefix's own outputs belong to its root
        alone.append(logits)
        alone_loss = alone_loss + loss(logits)
    alone_loss.backward()
    torch.testing.assert_close(shared, torch.cat(alone, dim=1), rtol=0, atol=TOLERANCE)
    alone_grads = gradients(model)
    assert shared_grads.keys() == alone_grads.keys()
    for name, grad in shared_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=0, atol=TOLERANCE, msg=name)


def test_spans_read_each_prefix_from_the_positions_at_its_start():
    _, documents, positions = shared_row()
    spans = document_spans(documents, positions)
    assert spans.lengths == ((9, 5, 4, 3, 2, 2),) and spans.prefixes == ((0, 6, 6, 0, 2, 0),)
    assert document_spans(documents).prefixes == ()  # without positions: documents of their own
    assert document_spans(documents, torch.zeros_like(positions)).prefixes == ()


@pytest.mark.parametrize("starts, message", [
    ((0, 10), r"^row 0, document 1: positions start at 10, but no earlier document starting at 0 has that many"),
    ((3, 0), r"^row 0, document 0: positions start at 3"),
    ((0, -1), r"^row 0, document 1: positions start at -1"),
])
def test_a_prefix_its_root_cannot_give_is_refused(starts, message):
    documents = torch.tensor([[0] * 4 + [1] * 3])
    positions = torch.cat([torch.arange(starts[0], starts[0] + 4), torch.arange(starts[1], starts[1] + 3)])[None]
    with pytest.raises(ValueError, match=message):
        document_spans(documents, positions)


def test_a_continuation_in_ids_that_come_back_is_refused():
    documents, positions = torch.tensor([[0, 0, 1, 1, 0]]), torch.tensor([[0, 1, 1, 2, 0]])
    with pytest.raises(ValueError, match="^documents that continue a shared prefix must be contiguous runs"):
        document_spans(documents, positions)


def test_padding_a_shared_row_adds_a_document_whose_positions_restart():
    """Sequence-splitting plans pad the row to a multiple; the padding must not read as a continuation."""
    ids, documents, positions = shared_row()
    batch = {"input_ids": ids, "document_ids": documents, "positions": positions}
    with padded_sequence(batch, 8):
        pass
    assert batch["positions"].shape == (1, 32) and batch["positions"][0, 25:].tolist() == list(range(7))
    assert batch["document_ids"][0, 25:].tolist() == [6] * 7
    assert document_spans(batch["document_ids"], batch["positions"]).prefixes == ((0, 6, 6, 0, 2, 0, 0),)
    plain = {"input_ids": ids, "positions": positions}  # no documents: one sequence, positions go on
    with padded_sequence(plain, 8):
        pass
    assert plain["positions"][0, 25:].tolist() == list(range(2, 9))


def test_the_cuda_varlen_call_gathers_each_continuations_prefix_keys(monkeypatch):
    """CPU has no varlen kernel, so a reference stands in for ``varlen_attn`` with flash attention's
    alignment for more keys than queries (the causal window ends at the last key): what is checked
    is the plumbing (gathered keys, separate key offsets) against the per-document path."""
    import torch.nn.attention.varlen as varlen_module
    import torch.nn.functional as F

    import posttune.modules.attention as attention_module
    from posttune.modules import Attention
    from posttune.modules.attention import varlen_spans

    calls = []

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append((max_q, max_k, tuple(window_size)))
        out = []
        for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                      zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
            n, m = q1 - q0, k1 - k0
            i, j = torch.arange(n)[:, None] + (m - n), torch.arange(m)[None, :]  # bottom-right aligned
            allowed = (j <= i) & ((i - j <= window_size[0]) if window_size[0] >= 0 else True)
            doc = [q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None]]
            out.append(F.scaled_dot_product_attention(*doc, attn_mask=allowed, scale=scale,
                                                      enable_gqa=enable_gqa)[0].transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setattr(varlen_module, "varlen_attn", reference)
    monkeypatch.setattr(attention_module, "_flash_can_run", lambda q: True)
    _, documents, positions = shared_row()
    plain = document_spans(documents, positions)
    spans = varlen_spans(plain.lengths, plain.prefixes, documents.shape[1], torch.device("cpu"))
    assert spans.cu_seqlens_k.tolist() == [0, 9, 20, 30, 33, 37, 39] and spans.max_length_k == 11
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 8)
    for window in (None, 4):
        q = torch.randn(1, 4, 25, 8, requires_grad=True)
        k, v = torch.randn(1, 2, 25, 8, requires_grad=True), torch.randn(1, 2, 25, 8, requires_grad=True)
        got = spans.attend(q, k, v, attn.dense, window=window, softcap=None, scale=None)
        got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        expected = plain.attend(q, k, v, attn.dense, window=window, softcap=None, scale=None)
        expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)
        for mine, theirs in zip(got_grads, expected_grads):  # the prefix keys get both documents' gradients
            torch.testing.assert_close(mine, theirs, rtol=0, atol=TOLERANCE)
    assert calls == [(9, 11, (-1, 0)), (9, 11, (3, 0))]
