"""KTO end to end: the ``unpaired`` format and its bad rows, the mismatched pairs of a batch, a tiny run that
learns and resumes, config refusals, and one step split two ways giving one update."""

from __future__ import annotations

from typing import Any

import pytest
from run_support import check_bundled_config, compose_run, feedback_rows, kto_config, metrics, write

import posttune_dpo


#: a perturbation of the policy after which the first batch's mismatched pairs have a positive mean log-ratio
PERTURB_SEED = 3


def test_unpaired_rows_read_strings_and_messages():
    from posttune_dpo.kto import unpaired

    row = unpaired({"prompt": "Hi", "completion": "Hello", "label": False})
    assert row.prompt == [{"role": "user", "content": "Hi"}]
    assert row.completion == [{"role": "assistant", "content": "Hello"}] and row.desirable is False
    chat = unpaired({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                     "completion": [{"role": "assistant", "content": "a"}], "label": True})
    assert len(chat.prompt) == 2 and chat.desirable is True


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Reverse: AB", "completion": "BA"}, "data.train: row 1: missing field 'label' (absent or null)"),
    ({"prompt": "Reverse: AB", "label": True}, "data.train: row 1: missing field 'completion' (absent or null)"),
    ({"completion": "BA", "label": True}, "data.train: row 1: missing field 'prompt' (absent or null)"),
    ({"prompt": "Reverse: AB", "completion": "BA", "label": "yes"},
     "data.train: row 1: field 'label' must be true (desirable) or false (undesirable), got 'yes'"),
    ({"prompt": "Reverse: AB", "completion": "BA", "label": 1},
     "data.train: row 1: field 'label' must be true (desirable) or false (undesirable), got 1"),
    ({"prompt": "Reverse: AB", "completion": [{"role": "assistant"}], "label": True},
     "data.train: row 1: field 'completion[0].content' must be a string (or a list of text parts)"),
])
def test_a_bad_row_is_named_in_one_line(llama_dpo, posttune_cli, tmp_path, row, message):
    rows = [{"prompt": "Reverse: ABC", "completion": "CBA", "label": True}, row]
    result = posttune_cli("train", str(write(tmp_path, kto_config(tmp_path, rows=rows))))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"posttune: error: {message} (set data.skip_bad_rows: true to "
                                                  f"skip such rows)"]


@pytest.mark.parametrize("sections, message", [
    ({"method": {"name": "kto", "beta": 0}}, "config: method.beta: expected a positive number, got 0"),
    ({"method": {"name": "kto", "desirable_weight": -1.0}},
     "config: method.desirable_weight: expected a positive number, got -1.0"),
    ({"method": {"name": "kto", "undesirable_weight": float("nan")}},
     "config: method.undesirable_weight: expected a finite number, got nan"),
    ({"train": {"batch_size": 1}}, "config: train.batch_size: kto estimates its KL reference point from each "
                                   "row's prompt with another row's completion; needs at least 2, got 1"),
    ({"method": {"name": "kto", "loss_type": "ipo"}}, "config: method.loss_type: unknown key"),
    ({"method": "dpo"}, "config: data.train.format: 'unpaired' gives feedback rows; method 'dpo' needs "
                        "preference rows"),
    ({"data": {"train": {"path": "x.jsonl", "format": "preference"}}},
     "config: data.train.format: 'preference' gives preference rows; method 'kto' needs feedback rows"),
])
def test_config_refusals_are_one_line_naming_the_field(llama_dpo, posttune_cli, tmp_path, sections, message):
    result = posttune_cli("validate", str(write(tmp_path, kto_config(tmp_path, **sections))))
    assert result.exit_code == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"posttune: error: {message}"), lines


@pytest.mark.parametrize("padding_free", [False, True])
def test_each_row_is_paired_with_the_previous_rows_completion(llama_dpo, tmp_path, padding_free):
    """The mismatched pair of row i is row i's prompt with row i - 1's completion (row 0 takes the last one's),
    TRL's rotation; the labels reach the batch by dataset row."""
    from run_support import pair_rows

    rows = feedback_rows(8)
    session = compose_run(kto_config(tmp_path, rows=rows, method={"name": "kto", "padding_free": padding_free}))
    batch = next(iter(session.train_data))
    n = batch["rows"].numel()
    assert n == 4 and batch["desirable"].tolist() == [rows[int(r)]["label"] for r in batch["rows"]]
    padded = pair_rows(batch)
    ids, labels = padded["input_ids"], padded["labels"]

    def parts(index: int) -> tuple[list[int], list[int]]:
        """(prompt ids up to the first target's position, completion ids after it) of padded row ``index``."""
        first = int((labels[index] != -100).nonzero()[0])
        kept = ids[index][: int((labels[index] != -100).nonzero()[-1]) + 2].tolist()
        return kept[: first + 1], kept[first + 1:]

    for i in range(n):
        prompt, _ = parts(i)
        _, completion = parts((i - 1) % n)
        assert parts(n + i) == (prompt, completion), i
    assert batch["kl_scored"].all()


@pytest.mark.parametrize("max_seq_len", [64, 9, 5], ids=["whole", "cut", "one_target_left"])
def test_a_mismatched_pair_cut_to_max_seq_len_scores_the_tokens_it_keeps(max_seq_len):
    """Row A's prompt followed by row B's completion, cut to ``max_seq_len`` as every sample is: the tokens kept,
    each completion token after the first a target of the position before it, and the last position none (its
    next token was cut off: the KL estimate scores no token past the cut, as the completions themselves)."""
    import torch

    from posttune.plugin import IGNORE_INDEX
    from posttune_dpo.kto import mismatched

    def sample(prompt: list[int], completion: list[int], row: int) -> Any:
        from posttune.data.samples import Sample

        ids = prompt + completion
        labels = [ids[t + 1] if t + 1 >= len(prompt) else IGNORE_INDEX for t in range(len(ids) - 1)]
        return Sample(torch.tensor(ids), torch.tensor([*labels, IGNORE_INDEX]), row)

    prompt_a, completion_b = [1, 2, 3, 4], [20, 21, 22, 23, 24, 25, 2]
    pair = mismatched(sample(prompt_a, [10, 11, 12, 2], 0), sample([5, 6, 7], completion_b, 1), max_seq_len)
    kept = (prompt_a + completion_b)[:max_seq_len]
    expected = [kept[t + 1] if t + 1 >= len(prompt_a) else IGNORE_INDEX for t in range(len(kept) - 1)]
    assert pair.ids.tolist() == kept and pair.row == 0
    assert pair.labels.tolist() == [*expected, IGNORE_INDEX]


def perturb(model: Any, seed: int = PERTURB_SEED, scale: float = 0.05) -> None:
    """Move the policy off its reference, so that the log-ratios, the rewards and z0 are not 0."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def test_padding_free_and_padded_batches_give_the_same_loss(llama_dpo, tmp_path):
    import torch

    from posttune_dpo.kto import loss

    outs = []
    for padding_free in (False, True):
        session = compose_run(kto_config(tmp_path / str(padding_free),
                                         method={"name": "kto", "padding_free": padding_free}))
        perturb(session.model)
        outs.append(loss(session, next(iter(session.train_data))))
    padded, free = outs
    torch.testing.assert_close(free.loss_sum, padded.loss_sum, rtol=0, atol=1e-5)
    for key, value in padded.metrics.items():
        total = value[0] if isinstance(value, tuple) else value
        got = free.metrics[key][0] if isinstance(value, tuple) else free.metrics[key]
        torch.testing.assert_close(got, total, rtol=0, atol=1e-4, msg=key)
    assert float(padded.metrics["kl"]) > 0


def test_the_methods_loss_is_the_formula_on_independent_log_probs(llama_dpo, tmp_path):
    """The method's loss, metrics and gradients on a padding-free batch equal KTO's formula on sequence
    log-probs computed independently (full logits of padded rows, log-softmax, gather, masked sum) for the
    completions and for each row's prompt with the previous row's completion; fp32, 1e-5."""
    import torch
    from run_support import pair_rows

    from posttune_dpo.kto import loss

    session = compose_run(kto_config(tmp_path, method={"name": "kto", "beta": 0.5, "desirable_weight": 1.5,
                                                       "undesirable_weight": 0.8}))
    perturb(session.model)
    batch = next(iter(session.train_data))
    out = loss(session, batch)
    out.loss_sum.backward()
    got = {name: p.grad.clone() for name, p in session.model.named_parameters()}
    session.model.zero_grad()

    padded = pair_rows(batch)

    def logps(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(padded["input_ids"]).float()
        mask = padded["labels"] != -100
        per_token = logits.log_softmax(-1).gather(-1, padded["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (per_token * mask).sum(-1).chunk(2)

    policy, policy_kl = logps(session.model)
    with torch.no_grad():
        reference, reference_kl = logps(session.models["reference"])
    z0 = (policy_kl.detach() - reference_kl).mean().clamp(min=0)
    desirable = batch["desirable"]
    r = policy - reference
    losses = torch.where(desirable, 1.5 * (1 - torch.sigmoid(0.5 * (r - z0))),
                         0.8 * (1 - torch.sigmoid(0.5 * (z0 - r))))
    losses.sum().backward()
    assert float(z0) > 0 and desirable.any() and not desirable.all()
    torch.testing.assert_close(out.loss_sum, losses.sum(), rtol=0, atol=1e-5)
    assert float(out.normaliser) == 4
    torch.testing.assert_close(out.metrics["kl"], z0, rtol=0, atol=1e-5)
    rewards = 0.5 * r.detach()
    for key, values, where in (("rewards/chosen", rewards, desirable), ("rewards/rejected", rewards, ~desirable),
                               ("logps/chosen", policy.detach(), desirable),
                               ("logps/rejected", policy.detach(), ~desirable)):
        total, count = out.metrics[key]
        torch.testing.assert_close(total, values[where].sum(), rtol=0, atol=1e-4, msg=key)
        assert float(count) == int(where.sum()), key
    for name, parameter in session.model.named_parameters():
        torch.testing.assert_close(got[name], parameter.grad, rtol=0, atol=1e-5, msg=name)


def test_kto_trains_desirable_rewards_above_undesirable_ones(llama_dpo, posttune_cli, tmp_path):
    """Eight prompts, each with its reversal (desirable) and its copy (undesirable): the policy learns to
    tell them apart. Measured: the validation reward margin grows from 0.15 (step 4) to 5.4 (step 32; asserted:
    0.5), the validation loss from 0.48 to 0.09."""
    config = kto_config(tmp_path, train={"epochs": 8, "lr": 3e-3, "eval_every": 4})
    config["data"]["validation"] = dict(config["data"]["train"])
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    records = metrics(config["checkpoint"]["output_dir"])
    assert [r["step"] for r in records] == list(range(1, 33))
    assert all(r["examples"] == 4 for r in records)  # the normaliser: examples
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl", "desirable_fraction"):
        assert key in records[-1] and f"val_{key}" in records[3], key
    assert records[0]["loss"] == 0.5 and records[0]["kl"] == 0.0  # before the first update: the reference
    first, last = records[3], records[-1]
    margin = last["val_rewards/chosen"] - last["val_rewards/rejected"]
    assert margin > 0.5, (first["val_rewards/chosen"] - first["val_rewards/rejected"], margin)
    assert last["val_loss"] < first["val_loss"] - 0.05


SPLIT_SEED = 1  # rows whose two micro-batches hold different numbers of scored tokens


def test_the_first_step_split_two_ways_gives_one_update(llama_dpo, tmp_path):
    """The loss is summed per example and divided once by the step's examples, so one step of batch 4 and
    one of batch 2 x accumulation 2 over the same rows, whose completions differ in length, give the same
    update (SGD, lr 1, no clipping: the update is the gradient). On the first step the policy is its
    reference, so z0 is 0 whatever pairs estimate it; later steps differ by z0 alone, which is estimated
    per micro-batch (as TRL's per device batch): docs/dpo.md, "KTO"."""
    import torch

    from posttune.training.trainer import train

    updates = []
    for batch, accumulation in ((4, 1), (2, 2)):
        root = tmp_path / f"{batch}x{accumulation}"
        session = compose_run(kto_config(
            root, rows=feedback_rows(8, seed=SPLIT_SEED),
            train={"optimizer": "sgd", "lr": 1.0, "max_grad_norm": None, "max_steps": 1, "weight_decay": 0.0,
                   "batch_size": batch, "grad_accum_steps": accumulation}))
        before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
        first = list(session.train_data)[:2]
        lengths = [int((b["labels"] != -100).sum()) for b in first]
        train(session)
        updates.append({n: before[n] - p.detach() for n, p in session.model.named_parameters()})
    assert len(set(lengths)) > 1  # the micro-batches hold different numbers of scored tokens
    for name, delta in updates[0].items():
        assert float(delta.abs().max()) > 0, name
        torch.testing.assert_close(updates[1][name], delta, atol=1e-6, rtol=0, msg=name)


def test_the_bundled_kto_config_is_valid(llama_dpo, posttune_cli):
    check_bundled_config(posttune_cli, posttune_dpo.CONFIGS, "kto-tiny-reverse")
    plan = posttune_cli("plan", "kto-tiny-reverse")
    assert plan.exit_code == 0, plan.stderr
    assert "roles        reference:" in plan.stdout


def test_text_rows_are_encoded_as_trls_kto_trainer_encodes_them(llama_dpo, tmp_path):
    """``unpaired_text``: TRL's standard rows, ``prompt + completion`` plus EOS with no chat template, the completion
    starting where the encoded prompt and the encoded whole part (TRL's KTOTrainer: its ``_tokenize`` and
    ``common_prefix_length``, after its ``add_eos``); half the prompts end in a space the tokenizer merges with the
    completion's "t". Message lists are refused, naming ``unpaired``."""
    trl_data = pytest.importorskip("trl.data_utils")
    from run_support import TOKENIZER
    from transformers import AutoTokenizer

    from posttune_dpo.kto import unpaired_text

    theirs = AutoTokenizer.from_pretrained(TOKENIZER)
    rows = [{"prompt": f"Reverse: {row['prompt'][9:]}\nAnswer:" + " " * (i % 2),
             "completion": ("the " if i % 2 else " ") + row["completion"], "label": row["label"]}
            for i, row in enumerate(feedback_rows(4))]
    session = compose_run(kto_config(tmp_path, rows=rows, method={"name": "kto", "padding_free": False},
                                     data={"train": {"path": str(tmp_path / "train.jsonl"),
                                                     "format": "unpaired_text"}}))
    batch = next(iter(session.train_data))
    for position, row in enumerate(batch["rows"].tolist()):
        prompt, completion = rows[row]["prompt"], rows[row]["completion"] + theirs.eos_token
        prompt_ids = trl_data._tokenize(theirs, prompt)["input_ids"]
        whole = trl_data._tokenize(theirs, prompt + completion)["input_ids"]
        start = trl_data.common_prefix_length(prompt_ids, whole)
        labels = batch["labels"][position]
        assert batch["input_ids"][position][: len(whole)].tolist() == whole
        assert [t + 1 for t in range(len(labels)) if labels[t] != -100] == list(range(start, len(whole))), row
    assert any(len(trl_data._tokenize(theirs, r["prompt"])["input_ids"]) != trl_data.common_prefix_length(
        trl_data._tokenize(theirs, r["prompt"])["input_ids"],
        trl_data._tokenize(theirs, r["prompt"] + r["completion"])["input_ids"]) for r in rows)  # a merge is met
    with pytest.raises(ValueError, match="field 'prompt' must be text in format unpaired_text, got list "
                                         r"\(message lists: use format unpaired\)"):
        unpaired_text({"prompt": [{"role": "user", "content": "Hi"}], "completion": "Hello", "label": True})


@pytest.mark.parametrize(("cell", "label"), [("True", True), ("false", False), (" TRUE ", True), (True, True)])
def test_a_csv_label_read_as_text_is_the_boolean_it_spells(cell, label):
    """CSV cells are read as written (text): the label column's ``True``/``False`` are its two values."""
    from posttune_dpo.kto import _label

    assert _label({"prompt": "p", "completion": "c", "label": cell}) is label
    with pytest.raises(ValueError, match="field 'label' must be true"):
        _label({"prompt": "p", "completion": "c", "label": "yes"})
