"""What TP shards and what it replicates, LoRA included, on a one-rank gloo mesh in this process
(layouts do not depend on the degree; the numbers across 2 and 4 ranks are in tests/distributed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from posttune_lora.layer import apply_lora
from posttune.training import distributed
from posttune_llama import LLAMA, LORA_TARGETS
from posttune_llama.model import build
from posttune_llama.sizes import LLAMA_SIZES
from posttune_tp.styles import apply_tp


@pytest.fixture
def tp_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def session_for(model, mesh, overrides=None, *, sequence_parallel=True):
    """What ``apply_tp(session, target)`` reads; ``session.target`` is the policy's target."""
    from posttune_tp import TPOptions

    target = SimpleNamespace(model=model, family=LLAMA, role="policy", trainable=True)
    options = TPOptions(sequence_parallel=sequence_parallel, styles=dict(overrides or {}))
    plan = SimpleNamespace(parallel_options={"tp": options})
    return SimpleNamespace(model=model, mesh={"tp": mesh}, step_contexts=[], target=target, plan=plan)


def apply(session):
    apply_tp(session, session.target)
    return session


def tiny(**overrides):
    torch.manual_seed(0)
    return build(**{**LLAMA_SIZES["tiny"], "vocab_size": 96, **overrides})


def placements(model, name):
    return tuple(model.get_parameter(name).placements)


def test_llama_plan_layout_and_tied_embedding(tp_mesh):
    model = tiny()
    apply(session_for(model, tp_mesh))
    assert placements(model, "embed.weight") == (Shard(0),)  # vocabulary rows
    assert model.output.weight is model.embed.weight  # still tied
    assert placements(model, "layers.0.attn.q_proj.weight") == (Shard(0),)  # colwise: output features
    assert placements(model, "layers.0.attn.o_proj.weight") == (Shard(1),)  # rowwise: input features
    assert placements(model, "layers.0.attn_norm.weight") == (Replicate(),)  # sequence parallel norm


def test_lora_under_tp_shards_with_its_base_and_stays_the_only_trainable_part(tp_mesh):
    model = tiny()
    apply_lora(model, targets=LORA_TARGETS, rank=4, alpha=8)
    apply(session_for(model, tp_mesh))
    colwise, rowwise = "layers.0.attn.q_proj", "layers.0.mlp.down_proj"
    assert placements(model, f"{colwise}.base.weight") == (Shard(0),)
    assert placements(model, f"{colwise}.lora_A.weight") == (Replicate(),)
    assert placements(model, f"{colwise}.lora_B.weight") == (Shard(0),)  # rows follow the base's output split
    assert placements(model, f"{rowwise}.base.weight") == (Shard(1),)
    assert placements(model, f"{rowwise}.lora_A.weight") == (Shard(1),)  # columns follow the base's input split
    assert placements(model, f"{rowwise}.lora_B.weight") == (Replicate(),)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # norms re-wrapped by TP stay frozen


def test_tp_forward_matches_the_plain_model_and_pads_the_sequence(tp_mesh):
    reference = tiny()
    model = tiny()
    session = apply(session_for(model, tp_mesh))
    batch = {"input_ids": torch.randint(0, 96, (2, 7)), "labels": torch.randint(0, 96, (2, 7))}
    with distributed.step_context(session, batch):
        logits = model(batch["input_ids"])
    assert not isinstance(logits, DTensor)
    torch.testing.assert_close(logits, reference(batch["input_ids"]), atol=1e-5, rtol=0)


def test_tp_forward_of_packed_rows_matches_the_plain_model_and_its_gradients(tp_mesh):
    """Packed rows attend per document (DocumentSpans) on the heads a rank holds; the sequence
    padding adds one more document, so the spans are found after it."""
    reference = tiny()
    model = tiny()
    session = apply(session_for(model, tp_mesh))
    ids = torch.randint(0, 96, (2, 7))
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
    batch = {"input_ids": ids.clone(), "labels": torch.randint(0, 96, (2, 7)), "document_ids": documents.clone()}
    with distributed.step_context(session, batch):
        logits = model(batch["input_ids"], document_ids=batch["document_ids"])
        logits[:, :7].logsumexp(-1).sum().backward()
    expected = reference(ids, document_ids=documents)
    expected.logsumexp(-1).sum().backward()
    torch.testing.assert_close(logits[:, :7], expected, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, reference.get_parameter(name).grad, atol=1e-5, rtol=0, msg=name)


def test_without_sequence_parallelism_norms_replicate_and_one_token_steps_work(tp_mesh):
    """What generation needs: a one-token decoding step cannot be split over the sequence."""
    from posttune_generate import generate_batch

    reference = tiny()
    model = tiny()
    session = apply(session_for(model, tp_mesh, sequence_parallel=False))
    norm = model.layers[0].attn_norm.weight  # the norm runs whole on each rank, its weight a replicated DTensor
    assert isinstance(norm, DTensor) and tuple(norm.placements) == (Replicate(),)
    assert session.step_contexts == []  # no sequence padding either
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    got = generate_batch(model, prompts, max_new_tokens=4).tokens
    torch.testing.assert_close(got, generate_batch(reference, prompts, max_new_tokens=4).tokens)


def test_vocab_sharded_head_returns_sharded_logits(tp_mesh):
    model = tiny()
    apply(session_for(model, tp_mesh, {"output": "colwise_vocab_sharded"}))
    logits = model(torch.randint(0, 96, (1, 4)))
    assert isinstance(logits, DTensor) and tuple(logits.placements) == (Shard(2),)


def test_padding_keeps_labels_ignored_and_documents_apart():
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[6, 7, -100]]),
             "document_ids": torch.tensor([[0, 0, 1]])}
    with distributed.padded_sequence(batch, 4):
        pass
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert batch["labels"].tolist() == [[6, 7, -100, -100]]
    assert batch["document_ids"].tolist() == [[0, 0, 1, 2]]


def test_a_family_without_a_tp_plan_is_refused_rather_than_left_whole(tp_mesh):
    """A third-party family that declares no ``tp_plan``: tp split nothing and every rank trained the whole model."""
    from dataclasses import replace

    from posttune.errors import PosttuneError

    session = session_for(tiny(), tp_mesh)
    session.target.family = replace(LLAMA, name="olmo2", tp_plan={})
    with pytest.raises(PosttuneError, match=r"^tp: family 'olmo2' declares no tp_plan \(ModelFamily\.tp_plan"):
        apply(session)
