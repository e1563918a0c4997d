"""GRPO's padding-free learner (``method.padding_free``, ``method.share_prompt``, the defaults): a micro-batch's
completions end to end in one row, each group's prompt computed once, give the padded rows' log-probs, loss,
metrics and gradients; the rows/documents mapping is pinned on its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from run_support import compose_run
from test_grpo_training import llama_grpo, vowel_config  # noqa: F401  (a fixture and a config)

from posttune.data import IGNORE_INDEX, documents_as_rows, rows_as_documents


def test_rows_become_documents_with_each_prompt_once_and_map_back():
    prompt = [5, 6, 7]
    completions = [[1, 2], [3], [4, 4, 4]]
    rows = [prompt + c for c in completions] + [[9, 8, 2]]  # a group of 3, then a row of another prompt
    width = 7
    input_ids = torch.zeros(4, width, dtype=torch.long)
    labels = torch.full((4, width), IGNORE_INDEX)
    for r, row in enumerate(rows):
        input_ids[r, :len(row)] = torch.tensor(row)
        labels[r, len(prompt) - 1:len(row) - 1] = torch.tensor(row[len(prompt):])
    labels[3] = IGNORE_INDEX
    labels[3, 1] = 2
    lengths = torch.tensor([len(row) for row in rows])
    flat = rows_as_documents(input_ids, labels, lengths, pad_id=0)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 1, 2, 7, 3, 7, 4, 4, 4, 9, 8, 2]]
    assert flat["document_ids"].tolist() == [[0] * 5 + [1] * 2 + [2] * 4 + [3] * 3]
    assert flat["positions"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 2, 3, 4, 5, 0, 1, 2]]
    back = documents_as_rows(flat["labels"].float(), flat, 4, width)
    kept = labels != IGNORE_INDEX
    assert back[kept].tolist() == labels[kept].float().tolist() and back[~kept].abs().sum() < 1e6
    whole = rows_as_documents(input_ids, labels, lengths, pad_id=0, share_prompt=False)
    assert whole["input_ids"].shape[1] == int(lengths.sum()) and int(whole["positions"].max()) == 5


@pytest.mark.parametrize("method", [{}, {"beta": 0.1, "num_iterations": 2}, {"top_entropy_quantile": 0.5}],
                         ids=["reinforce", "kl_and_passes", "high_entropy_tokens"])
def test_the_padding_free_learner_gives_the_padded_rows_loss_and_gradients(llama_grpo, tmp_path, method):  # noqa: F811
    """The same rollouts scored and trained on with padded rows and padding-free ones (prompt shared or not):
    the reference's and old log-probs (``scored_by``), the loss, its metrics and its gradients, fp32."""
    from posttune_grpo.in_process import scored_by
    from posttune_grpo.method import batches

    session = compose_run(vowel_config(tmp_path, method=method))
    batch = next(iter(batches(session)))
    rollouts = session.method_state.pending
    config = session.method_config
    results = {}
    for name, layout in {"padded": {"padding_free": False}, "whole": {"share_prompt": False}, "shared": {}}.items():
        session.method_config = dataclasses.replace(config, **{"padding_free": True, "share_prompt": True, **layout})
        scored = scored_by(session, rollouts, session.model, len(rollouts))
        session.model.zero_grad(set_to_none=True)
        out = session.plan.method.descriptor.loss(session, batch)
        (out.loss_sum / out.normaliser).backward()
        grads = {n: p.grad.clone() for n, p in session.model.named_parameters()}
        results[name] = (scored, out, grads)
    padded_scored, padded, padded_grads = results["padded"]
    mask = rollouts.labels != IGNORE_INDEX
    assert mask.any() and (rollouts.prompt_lengths.float().mean() > rollouts.lengths.float().mean())
    for name in ("whole", "shared"):
        scored, out, grads = results[name]
        torch.testing.assert_close(scored[mask], padded_scored[mask], rtol=0, atol=1e-5, msg=name)
        assert scored[~mask].abs().sum() == 0
        torch.testing.assert_close(out.loss_sum, padded.loss_sum, rtol=0, atol=1e-6, msg=name)
        for key, (total, _count) in padded.metrics.items():
            torch.testing.assert_close(out.metrics[key][0], total, rtol=0, atol=1e-5, msg=f"{name} {key}")
        for key, grad in padded_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=0, atol=1e-6, msg=f"{name} {key}")


def test_the_learner_forward_holds_each_prompt_once(llama_grpo, tmp_path, monkeypatch):  # noqa: F811
    from posttune_grpo.method import batches

    session = compose_run(vowel_config(tmp_path))
    batch = next(iter(batches(session)))
    widths = []
    session.model.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape))
    session.plan.method.descriptor.loss(session, batch)
    rollouts = session.method_state.pending
    groups, size = len(rollouts) // 4, 4
    prompts = rollouts.prompt_lengths.view(groups, size)[:, 0]
    expected = int((rollouts.prompt_lengths + rollouts.lengths).sum() - ((prompts - 1) * (size - 1)).sum())
    assert widths == [torch.Size([1, expected])]

