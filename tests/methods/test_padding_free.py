"""SFT's, DPO's and the reward model's `method.padding_free` (their default): a batch's samples end to end
in one row give the padded batch's losses and gradients, step after step, without computing any padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_support import assert_same_step, compose_run, dpo_config, sft_config

from posttune.data import IGNORE_INDEX
from posttune.data.collate import flat_batch, pad_id, padded_batch, pair_batch
from posttune.data.samples import Sample
from posttune.errors import ConfigError
from posttune.checkpoint.score_head import sequence_scores
from posttune.losses import sequence_logps
from posttune.training.metrics import read_metrics
from posttune.training.trainer import train


def sample(ids: list[int], labels: list[int], row: int) -> Sample:
    return Sample(ids=torch.tensor(ids), labels=torch.tensor(labels), row=row)


def test_flat_batch_puts_the_samples_end_to_end_as_documents():
    samples = [[sample([5, 6, 7], [IGNORE_INDEX, 7, 2], 0)], [sample([8, 9], [9, 2], 1)]]
    flat = flat_batch(samples, pad_id=0)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert flat["labels"].tolist() == [[IGNORE_INDEX, 7, 2, 9, 2]]
    assert flat["document_ids"].tolist() == [[0, 0, 0, 1, 1]] and int(flat["num_tokens"]) == 5
    rounded = flat_batch(samples, pad_id=0, pad_to_multiple_of=4)
    assert rounded["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert rounded["labels"][0, 5:].eq(IGNORE_INDEX).all() and rounded["document_ids"].tolist()[0][5:] == [2, 2, 2]
    padded = padded_batch(samples, pad_id=0)
    assert int(padded["num_tokens"]) == 5 and padded["input_ids"].shape == (2, 3)


def test_flat_pair_batch_holds_the_padded_rows_as_documents_in_order():
    pairs = [[sample([1, 2, 3], [IGNORE_INDEX, 3, 2], 7), sample([1, 4], [IGNORE_INDEX, 2], 7)],
             [sample([5, 6], [6, 2], 9), sample([5, 6, 8, 8], [IGNORE_INDEX, 8, 8, 2], 9)]]
    flat = pair_batch(pairs, pad_id=0, padding_free=True)
    padded = pair_batch(pairs, pad_id=0)
    assert flat["input_ids"].tolist() == [[1, 2, 3, 5, 6, 1, 4, 5, 6, 8, 8]]  # chosen 0, 1, then rejected 0, 1
    assert flat["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 3]]
    for document, (ids, labels) in enumerate(zip(padded["input_ids"], padded["labels"])):
        length, mine = len(pairs[document % 2][document // 2]), flat["document_ids"][0] == document
        assert flat["input_ids"][0][mine].tolist() == ids[:length].tolist()
        assert flat["labels"][0][mine].tolist() == labels[:length].tolist()
    assert flat["rows"].tolist() == padded["rows"].tolist() == [7, 9]
    assert int(flat["num_tokens"]) == int(padded["num_tokens"]) == 11
    empty = pair_batch([], pad_id=0, padding_free=True)  # a rank's empty share: one placeholder pair, no targets
    assert empty["rows"].tolist() == [-1] and empty["document_ids"].tolist() == [[0, 1]]
    assert empty["labels"].eq(IGNORE_INDEX).all() and int(empty["num_tokens"]) == 0


@pytest.mark.parametrize("average", [False, True])
def test_sequence_logps_per_document_equals_per_padded_row(average):
    values = torch.arange(1.0, 13.0).view(2, 6)
    labels = torch.tensor([[IGNORE_INDEX, 1, 1, 1, IGNORE_INDEX, 1], [1, IGNORE_INDEX, 1, 1, 1, IGNORE_INDEX]])
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1]])  # row 1 uses no id 2: it gets 0
    got = sequence_logps(values, labels, average=average, document_ids=documents)
    assert got.shape == (2, 3)
    for row in range(2):
        for document in range(3):
            mine = documents[row] == document
            want = sequence_logps(values[row][mine][None], labels[row][mine][None], average=average)[0] \
                if mine.any() else torch.tensor(0.0)
            assert float(got[row, document]) == pytest.approx(float(want)), (row, document)
    assert float(got[0, 1]) == (3 + 4) / (2 if average else 1)  # position 4 has no target


def test_sequence_scores_per_document_pool_as_per_padded_row():
    """Each document's score at its last token that is not the pad id, its first if it has none,
    as transformers pools a padded row; a document id a row does not use gets the row's first position."""
    scores = torch.arange(24.0).view(2, 6, 2)
    ids = torch.tensor([[5, 6, 0, 7, 0, 0], [9, 9, 9, 8, 8, 8]])  # pad id 0
    documents = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 0, 0, 1, 1, 1]])
    got = sequence_scores(scores, ids, 0, document_ids=documents)
    assert got.shape == (2, 3, 2)
    for row, document, position in [(0, 0, 1), (0, 1, 3), (0, 2, 4), (1, 0, 2), (1, 1, 5), (1, 2, 0)]:
        assert got[row, document].tolist() == scores[row, position].tolist(), (row, document)
    for row in range(2):  # one document per padded row: the padded pooling's answer
        for document in range(2):
            mine = documents[row] == document
            want = sequence_scores(scores[row][mine][None], ids[row][mine][None], 0)[0]
            assert got[row, document].tolist() == want.tolist(), (row, document)


def losses(tmp_path: Path, make=sft_config, **method) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    config = make(tmp_path, rows=16, train={"max_steps": 4, "batch_size": 4, "lr": 3e-3}, method=method)
    session = compose_run(config)
    first = next(iter(session.train_data))
    train(session)
    records = read_metrics(Path(config["checkpoint"]["output_dir"]))
    weights = {name: p.detach().clone() for name, p in session.model.named_parameters()}
    return [r["loss"] for r in records], [r["tokens"] for r in records], {"batch": first, **weights}


def assert_same_training(ours: tuple[list[float], dict], theirs: tuple[list[float], dict]) -> None:
    """Per-step losses and final weights of two ``losses`` runs equal within 1e-5."""
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-5)
    for name, weight in theirs[1].items():
        if name != "batch":
            torch.testing.assert_close(ours[1][name], weight, rtol=0, atol=1e-5, msg=name)


def test_padding_free_training_equals_padded_training(llama_dpo, tmp_path):
    flat_losses, flat_tokens, flat = losses(tmp_path / "flat")
    padded_losses, padded_tokens, padded = losses(tmp_path / "padded", padding_free=False)
    assert flat["batch"]["input_ids"].shape[0] == 1 and padded["batch"]["input_ids"].shape[0] == 4
    assert flat["batch"]["input_ids"].numel() < padded["batch"]["input_ids"].numel()  # no padding computed
    assert flat_tokens == padded_tokens and len(flat_losses) == 4
    assert_same_training((flat_losses, flat), (padded_losses, padded))


def test_the_old_data_keys_are_refused_naming_the_method_setting(llama_dpo, tmp_path):
    for key in ("padding_free", "packing"):
        with pytest.raises(ConfigError, match=rf"^config: data\.{key}: moved: set method\.{key}$"):
            compose_run(sft_config(tmp_path, data={key: False}))


def test_packed_rows_go_end_to_end_without_their_tails_and_train_as_fixed_rows_do(llama_dpo, tmp_path):
    """``packing: true`` (padding-free by default): each step's packed rows, the same documents in the
    same order, in one row with no tail padding; losses and weights as with rows of exactly max_seq_len."""
    flat_losses, flat_tokens, flat = losses(tmp_path / "flat", packing=True)
    fixed_losses, fixed_tokens, fixed = losses(tmp_path / "fixed", packing=True, padding_free=False)
    assert fixed["batch"]["input_ids"].shape == (4, 48)  # 4 packed rows of max_seq_len
    row = flat["batch"]
    assert row["input_ids"].shape[0] == 1 and row["input_ids"].shape[1] == int(row["num_tokens"])  # no padding
    kept = fixed["batch"]["labels"] != IGNORE_INDEX  # the fixed rows' documents, in order, tails dropped
    assert row["labels"][0][row["labels"][0] != IGNORE_INDEX].tolist() == fixed["batch"]["labels"][kept].tolist()
    documents = fixed["batch"]["document_ids"]
    assert row["document_ids"][0].unique().numel() == sum(documents[r][kept[r]].unique().numel() for r in range(4))
    assert flat_tokens == fixed_tokens and len(flat_losses) == 4 and flat_losses[0] != flat_losses[-1]
    assert_same_training((flat_losses, flat), (fixed_losses, fixed))


def test_shared_prompt_pairs_hold_each_prompt_once_and_the_rest_of_each_response():
    prompt = [1, 2, 3]  # the last prompt token predicts each response's first token: both keep it
    pairs = [[sample(prompt + [4, 5], [IGNORE_INDEX, IGNORE_INDEX, 4, 5, 2], 7),
              sample(prompt + [6], [IGNORE_INDEX, IGNORE_INDEX, 6, 2], 7)],
             [sample([9, 8], [8, 2], 9), sample([9, 7, 7], [7, 7, 2], 9)]]  # no untrained prefix: nothing shared
    shared = pair_batch(pairs, pad_id=0, padding_free=True, share_prompt=True, pad_to_multiple_of=8)
    assert shared["input_ids"].tolist() == [[1, 2, 3, 4, 5, 3, 6, 9, 8, 9, 7, 7, 0, 0, 0, 0]]
    assert shared["labels"].tolist()[0][:12] == [IGNORE_INDEX, IGNORE_INDEX, 4, 5, 2, 6, 2, 8, 2, 7, 7, 2]
    assert shared["document_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4]]
    assert shared["positions"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2, 3]]
    assert shared["rows"].tolist() == [7, 9] and int(shared["num_tokens"]) == 14  # what the pairs hold
    empty = pair_batch([], pad_id=0, padding_free=True, share_prompt=True)
    assert empty["document_ids"].tolist() == [[0, 1]] and empty["positions"].tolist() == [[0, 0]]
    assert empty["labels"].eq(IGNORE_INDEX).all()


#: how far 4 steps of Adam (lr 3e-3) may take two runs of pairs whose gradients differ only by rounding: Adam's first
#: steps turn rounding in near-zero gradients into whole updates (a sign is an update of lr), and where that happens
#: depends on the CPU's rounding (AVX2 vs AVX-512). Measured: padding-free vs padded DPO within 1e-5 on the Intel
#: machines, 2.7e-5 (loss) and 1.9e-4 (a weight) on an AMD EPYC; shared prompts 6e-5 after three steps.
#: ``assert_pair_layouts_step_equal`` pins one step exactly (1e-6), where nothing amplifies the rounding.
PAIR_LOSSES_ATOL = 5e-4


def test_padding_free_dpo_equals_padded_dpo(llama_dpo, tmp_path):
    """Rewards and log-probs per pair and 4 steps' losses: the same as padded pairs, each pair's prompt
    computed once (the default) or once per response, within ``PAIR_LOSSES_ATOL``."""
    twice_losses, twice_tokens, twice = losses(tmp_path / "twice", make=dpo_config, name="dpo", share_prompt=False)
    padded_losses, padded_tokens, padded = losses(tmp_path / "padded", make=dpo_config, name="dpo", padding_free=False)
    shared_losses, shared_tokens, shared = losses(tmp_path / "shared", make=dpo_config, name="dpo")
    assert twice["batch"]["input_ids"].shape[0] == 1 and padded["batch"]["input_ids"].shape[0] == 8
    assert "positions" in shared["batch"] and "positions" not in twice["batch"]
    # no padding computed; and the prompts once
    assert (shared["batch"]["input_ids"].numel() < twice["batch"]["input_ids"].numel()
            < padded["batch"]["input_ids"].numel())
    assert shared_tokens == twice_tokens == padded_tokens and len(twice_losses) == 4
    assert twice_losses[0] != twice_losses[-1]
    torch.testing.assert_close(twice_losses, padded_losses, rtol=0, atol=PAIR_LOSSES_ATOL)
    torch.testing.assert_close(shared_losses, padded_losses, rtol=0, atol=PAIR_LOSSES_ATOL)


def assert_pair_layouts_step_equal(session, loss) -> None:
    """One step's loss, metrics and gradients on the same weights and pairs, in the three layouts: each
    prompt computed once (``share_prompt``), once per response, and padded rows (fp32; the gradients of
    a sum over 4 pairs, 1e-6)."""
    pairs = [session.train_data.get_item(index) for index in range(4)]
    results = {}
    for layout, flat, share in (("shared", True, True), ("twice", True, False), ("padded", False, False)):
        batch = pair_batch(pairs, pad_id=pad_id(session.tokenizer), padding_free=flat, share_prompt=share)
        session.model.zero_grad()
        out = loss(session, batch)
        out.loss_sum.backward()
        grads = {name: p.grad.clone() for name, p in session.model.named_parameters() if p.grad is not None}
        results[layout] = (batch["input_ids"].shape, out, grads)
    assert results["shared"][0][1] < results["twice"][0][1] and results["twice"][0][0] == 1
    assert results["padded"][0][0] == 8  # a row per response
    _, twice, twice_grads = results["twice"]
    assert len(twice_grads) > 0
    for layout in ("shared", "padded"):
        assert_same_step(results[layout][1:], (twice, twice_grads), loss_atol=1e-6, msg=layout)


def test_each_pair_layout_gives_the_dpo_loss_and_gradients_of_padded_pairs(llama_dpo, tmp_path):
    from posttune_dpo.method import loss

    session = compose_run(dpo_config(tmp_path, rows=16, train={"batch_size": 4}, method={"name": "dpo"}))
    assert_pair_layouts_step_equal(session, loss)


def test_each_pair_layout_gives_the_reward_model_loss_and_gradients_of_padded_pairs(llama_dpo, register_plugin,
                                                                                     tmp_path):
    import posttune_rm
    from posttune_rm.method import loss

    register_plugin(posttune_rm, distribution="posttune-rm", version="0.1.0")
    config = {**dpo_config(tmp_path, rows=16, train={"batch_size": 4}), "method": {"name": "reward_model"}}
    assert_pair_layouts_step_equal(compose_run(config), loss)


def test_padding_free_reward_model_equals_padded(llama_dpo, register_plugin, tmp_path):
    """The reward model's pairs (posttune-rm): rewards and 4 steps' losses as with padded pairs, each prompt
    computed once (the default) or once per response, within ``PAIR_LOSSES_ATOL``."""
    import posttune_rm

    def rm_config(tmp_path: Path, *, method: dict, **sections) -> dict:
        return {**dpo_config(tmp_path, **sections), "method": method}  # DPO's pairs, without its settings

    register_plugin(posttune_rm, distribution="posttune-rm", version="0.1.0")
    flat_losses, flat_tokens, flat = losses(tmp_path / "flat", make=rm_config, name="reward_model",
                                            share_prompt=False)
    padded_losses, padded_tokens, padded = losses(tmp_path / "padded", make=rm_config, name="reward_model",
                                                  padding_free=False)
    shared_losses, shared_tokens, shared = losses(tmp_path / "shared", make=rm_config, name="reward_model")
    assert flat["batch"]["input_ids"].shape[0] == 1 and padded["batch"]["input_ids"].shape[0] == 8
    assert flat["batch"]["input_ids"].numel() < padded["batch"]["input_ids"].numel()  # no padding computed
    assert shared["batch"]["input_ids"].numel() < flat["batch"]["input_ids"].numel()  # and the prompts once
    assert flat_tokens == padded_tokens == shared_tokens and len(flat_losses) == 4 and flat_losses[0] != flat_losses[-1]
    torch.testing.assert_close(flat_losses, padded_losses, rtol=0, atol=PAIR_LOSSES_ATOL)
    torch.testing.assert_close(shared_losses, padded_losses, rtol=0, atol=PAIR_LOSSES_ATOL)


def test_sft_refuses_to_group_packed_rows(llama_dpo, tmp_path):
    with pytest.raises(ConfigError, match=r"^config: data\.group_by_length: packed rows are already full and need no "
                                          r"grouping; set method\.packing or data\.group_by_length, not both$"):
        compose_run(sft_config(tmp_path, method={"packing": True}, data={"group_by_length": True}))
