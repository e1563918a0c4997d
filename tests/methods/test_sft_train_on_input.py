"""``method.train_on_input``: the prompt's tokens are trained too (torchtune's ``train_on_input``, TRL's
``completion_only_loss: false``); the run's own loader honours it, on the same rows in the same order."""

from __future__ import annotations

import torch
from run_support import compose_run, sft_config


def first_batch(tmp_path, train_on_input: bool) -> dict:
    session = compose_run(sft_config(tmp_path, method={"name": "sft", "train_on_input": train_on_input},
                                     data={"shuffle": False}))
    return next(iter(session.train_data))


def test_train_on_input_labels_the_prompt_tokens_as_well(llama_sft, tmp_path):
    answers, everything = first_batch(tmp_path / "answers", False), first_batch(tmp_path / "all", True)
    assert torch.equal(answers["input_ids"], everything["input_ids"])
    trained = answers["labels"] != -100
    assert torch.equal(everything["labels"][trained], answers["labels"][trained])  # the answers' targets kept
    # every real token but each document's last (nothing follows it) is a target now; before, only the answers'
    documents = everything["document_ids"].unique().numel()
    labelled = int((everything["labels"] != -100).sum())
    assert labelled == int(everything["real_tokens"].sum()) - documents and labelled > int(trained.sum())
