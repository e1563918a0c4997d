"""Packed rows attend per document (``DocumentSpans``): exactly what each document gives alone.

The decoder finds a packed batch's documents once per forward and every layer attends within
each of them (modules/attention.py). These tests pin that path to the definition: forward and
gradients equal each document run alone (fp32, 1e-5), for GQA, biased projections, sliding
windows (binding inside a document or not) and soft-capped attention; the boolean-mask path
gives the same; and a compiled decoder layer graph-breaks around it without recompiling per
batch layout.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posttune.modules import (Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding,
                              attention_mask, default_positions)
from posttune.modules.attention import DocumentSpans, document_spans

VOCAB = 64
TOLERANCE = 1e-5
LENGTHS = ((5, 3, 9, 7), (11, 13))  # two packed rows of 24 tokens; row 1 ends in 13 tokens of "padding"


def decoder(*, kv_heads: int = 2, bias: bool = False, window: int | None = None, softcap: float | None = None,
            seed: int = 0) -> Decoder:
    """Two layers, hidden 32, 4 query heads of 8 dims; the first layer takes ``window`` and ``softcap``."""
    torch.manual_seed(seed)
    layers = [DecoderLayer(Attention(32, 4, kv_heads, 8, bias=bias, sliding_window=window if index == 0 else None,
                                     softcap=softcap if index == 0 else None),
                           GatedMLP(32, 64), RMSNorm(32), RMSNorm(32)) for index in range(2)]
    return Decoder(nn.Embedding(VOCAB, 32), layers, RMSNorm(32), RotaryEmbedding(8))


def packed_rows(lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and document ids [rows, 24] of documents with the given lengths."""
    ids = torch.randint(0, VOCAB, (len(lengths), sum(lengths[0])), generator=torch.Generator().manual_seed(seed))
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    return ids, documents


def loss(logits: torch.Tensor) -> torch.Tensor:
    """A per-token loss whose sum over a packed row is the sum over its documents."""
    return logits.logsumexp(-1).sum()


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def run_packed_and_alone(model: Decoder) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Logits and gradients of the packed rows, and of every document run on its own (summed)."""
    ids, documents = packed_rows()
    packed = model(ids, document_ids=documents)
    loss(packed).backward()
    packed_grads = gradients(model)
    alone_rows, alone_loss = [], 0.0
    for row, lengths in zip(ids, LENGTHS):
        outputs = [model(doc[None]) for doc in row.split(lengths)]
        alone_loss = alone_loss + sum(loss(out) for out in outputs)
        alone_rows.append(torch.cat(outputs, dim=1))
    alone_loss.backward()
    return packed, torch.cat(alone_rows), packed_grads, gradients(model)


@pytest.mark.parametrize("options", [{}, {"kv_heads": 4}, {"kv_heads": 1, "bias": True}, {"window": 4},
                                     {"window": 30}, {"softcap": 0.5}, {"softcap": 0.5, "window": 6}],
                         ids=["gqa", "mha", "mqa_bias", "window_binds", "window_wider", "softcap", "softcap_window"])
def test_packed_rows_give_each_document_alone_forward_and_gradients(options):
    model = decoder(**options)
    packed, alone, packed_grads, alone_grads = run_packed_and_alone(model)
    torch.testing.assert_close(packed, alone, rtol=0, atol=TOLERANCE)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=0, atol=TOLERANCE, msg=name)


def test_document_path_equals_the_mask_path_layer_by_layer():
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 8, bias=True)
    ids, documents = packed_rows()
    x = torch.randn(*ids.shape, 32)
    cos, sin = RotaryEmbedding(8)(default_positions(*ids.shape, document_ids=documents))
    spans = document_spans(documents)
    mask = attention_mask(ids.shape[1], ids.shape[1], document_ids=documents)
    torch.testing.assert_close(attn(x, cos, sin, spans), attn(x, cos, sin, mask), rtol=0, atol=TOLERANCE)


def test_spans_are_runs_of_one_id_and_none_when_an_id_comes_back():
    _, documents = packed_rows()
    assert document_spans(documents).lengths == LENGTHS
    assert document_spans(torch.tensor([[3, 3, 3, 3]])).lengths == ((4,),)
    assert document_spans(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])).lengths == ((2, 2), (1, 3))
    assert document_spans(torch.tensor([[0, 1, 0, 0]])) is None  # only a mask keeps these apart


def test_a_layout_the_spans_cannot_express_falls_back_to_the_mask(monkeypatch):
    import posttune.modules.decoder as decoder_module

    masks = []
    monkeypatch.setattr(decoder_module, "attention_mask",
                        lambda *args, **kwargs: masks.append(attention_mask(*args, **kwargs)) or masks[-1])
    model = decoder().eval()
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1]])  # documents interleaved
    with torch.no_grad():
        model(ids, document_ids=documents)
    assert len(masks) == 1 and masks[0][0, 0, 5].tolist() == [True, True, False, False, True, True, False, False]


def test_packed_decoder_builds_no_attention_mask(monkeypatch):
    import posttune.modules.decoder as decoder_module

    def refuse(*_args, **_kwargs):
        raise AssertionError("a packed batch should not build an [s, s] mask")

    monkeypatch.setattr(decoder_module, "attention_mask", refuse)
    ids, documents = packed_rows()
    decoder(window=4, softcap=0.5)(ids, document_ids=documents).sum().backward()


def test_compiled_layer_breaks_around_the_document_loop_and_does_not_recompile_per_layout():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = decoder()
    layer = model.layers[0]
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter)
    frames = []
    for lengths in (LENGTHS, ((12, 12), (1, 2, 3, 18)), ((24,), (6, 6, 6, 6))):
        ids, documents = packed_rows(lengths, seed=len(lengths[1]))
        x = model.embed(ids).detach().requires_grad_()
        cos, sin = model.rope(default_positions(*ids.shape, document_ids=documents))
        spans = document_spans(documents)
        expected = layer(x, cos, sin, spans)
        out = compiled(x, cos, sin, spans)
        torch.testing.assert_close(out, expected, rtol=0, atol=TOLERANCE)
        out.sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == [frames[0]] * 3  # graphs around the break, compiled once for all layouts


def test_document_spans_are_what_the_layers_receive():
    seen = []
    model = decoder()
    model.layers[1].attn.register_forward_pre_hook(lambda _module, args: seen.append(args[3]))
    ids, documents = packed_rows()
    model(ids, document_ids=documents)
    assert isinstance(seen[0], DocumentSpans) and seen[0].lengths == LENGTHS


def test_the_cuda_varlen_call_gets_token_major_documents_and_the_window_as_flash_reads_it(monkeypatch):
    """CPU has no varlen kernel, so a reference stands in for ``varlen_attn``: what is checked is
    the plumbing (token-major [b*s, heads, d] layout, cumulative offsets, (w - 1, 0) windows)."""
    import torch.nn.attention.varlen as varlen_module
    import torch.nn.functional as F

    import posttune.modules.attention as attention_module

    calls = []

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append((max_q, tuple(window_size)))
        out = []
        for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            n = end - start
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            allowed = (j <= i) & ((i - j <= window_size[0]) if window_size[0] >= 0 else True)
            doc = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
            out.append(F.scaled_dot_product_attention(*doc, attn_mask=allowed, scale=scale,
                                                      enable_gqa=enable_gqa)[0].transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setattr(varlen_module, "varlen_attn", reference)
    monkeypatch.setattr(attention_module, "_flash_can_run", lambda q: q.dtype == torch.float16)
    _, documents = packed_rows()
    plain = document_spans(documents)
    flat = [n for row in LENGTHS for n in row]
    spans = DocumentSpans(plain.lengths, torch.tensor([0, *flat]).cumsum(0).to(torch.int32), max(flat))
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 8).half(), torch.randn(2, 2, 24, 8).half(), torch.randn(2, 2, 24, 8).half()
    attn = Attention(32, 4, 2, 8, sliding_window=4)
    got = spans.attend(q, k, v, attn.dense, window=4, softcap=None, scale=None)
    expected = plain.attend(q.float(), k.float(), v.float(), attn.dense, window=4, softcap=None, scale=None)
    assert calls == [(13, (3, 0))]
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=2e-3)


def test_a_checkpointed_layer_recomputes_the_document_path_exactly():
    from torch.utils.checkpoint import checkpoint

    model = decoder(window=4)
    layer = model.layers[0]
    ids, documents = packed_rows()
    cos, sin = model.rope(default_positions(*ids.shape, document_ids=documents))
    spans = document_spans(documents)
    x = model.embed(ids).detach()
    plain_x, checkpointed_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(plain_x, cos, sin, spans).square().sum().backward()
    plain = gradients(layer)
    checkpoint(layer, checkpointed_x, cos, sin, spans, use_reentrant=False).square().sum().backward()
    torch.testing.assert_close(checkpointed_x.grad, plain_x.grad, rtol=0, atol=TOLERANCE)
    for name, grad in gradients(layer).items():
        torch.testing.assert_close(grad, plain[name], rtol=0, atol=TOLERANCE, msg=name)
