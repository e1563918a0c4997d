"""posttune-dpo's loss equals TRL's on the same weights and the same preference rows (fp32, 1e-6).

One tiny random Llama checkpoint is the reference; the same weights, perturbed, are the policy.
Both libraries load both checkpoints from disk and read the same conversational rows; TRL runs
a real ``trl.DPOTrainer`` (``learning_rate=0``: every logged loss is of the initial weights, and
Trainer computes a step's loss before its update) and posttune its method's ``loss`` on the
composed session's first batch. Before the losses are compared, each pair's scored tokens
(their ids and positions) and every token before them are checked to be the same in both.

What is compared, and why only that:

- ``sigmoid`` (DPO) and ``ipo``: the same formula in both (TRL's IPO, like posttune's, divides each
  response's log-ratio by its number of completion tokens). Loss, and for ``sigmoid`` the logged
  rewards and log-probs too. posttune's IPO rewards and ``logps/*`` are per-token means (the
  quantity IPO's loss uses); TRL logs token sums for every loss type, so those are not compared.
- cDPO (``label_smoothing``): TRL 1.x no longer smooths ``sigmoid``; its ``robust`` loss is a
  different formula (the flipped term is subtracted and the sum rescaled by ``1/(1 - 2 eps)``).
  Its ``aot`` loss is ``-(1-eps) log sigmoid(beta d) - eps log sigmoid(-beta d)`` with ``d`` the
  *batch-sorted* policy log-ratios minus the batch-sorted reference log-ratios: with one pair per
  batch sorting is the identity and ``d`` is DPO's ``(pi_c - ref_c) - (pi_r - ref_r)``, so
  one-pair batches of ``aot`` are exactly cDPO. posttune's mean over four pairs is compared with
  the mean of TRL's four one-pair steps.
- ``hinge`` and ``robust``: TRL's loss types of those names, the same formulas (``robust`` with
  ``label_smoothing`` as the flip rate).
- RPO (``rpo_alpha``): TRL 1.x has no ``rpo_alpha`` any more; RPO is ``loss_type: [sigmoid, sft]``
  with ``loss_weights: [1, alpha]``, its ``sft`` term the mean NLL over the batch's chosen tokens.
  posttune's NLL is each chosen response's per-token mean, averaged over pairs (so it does not
  depend on how a step is split, docs/dpo.md); with one pair per batch the two are the same, so
  posttune's mean over four pairs is compared with the mean of TRL's four one-pair steps.
- f-DPO (``f_divergence_type``: forward KL, Jensen-Shannon, alpha-divergence), on ``sigmoid`` and ``hinge``: TRL's
  same settings; the loss, the rewards and log-probs (the rewards stay ``beta`` x the log-ratios in both).
- loss lists (``loss_type: [...]`` with ``loss_weights``, as TRL's): MPO's ``[sigmoid, bco_pair, sft]``
  (one-pair steps, for its ``sft`` term as for RPO's), and ``[sigmoid, ipo]``, a loss on token sums and one on
  per-token means in one sum. The loss, and the rewards and log-probs (the first listed loss's, as TRL's).
- ``sigmoid_norm``, ``exo_pair``, ``nca_pair``, ``bco_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down`` and
  ``discopop``: TRL's loss types of those names (``exo_pair`` with ``label_smoothing`` 1e-3, ``discopop`` with
  ``discopop_tau`` 0.3), the loss and, but for ``sigmoid_norm`` (mean log-probs), the rewards and log-probs.
- WPO (``wpo_weights``, TRL's ``use_weighting``) on ``sigmoid``: the loss, the rewards and log-probs (unweighted in
  both). (TRL 1.16 cannot run it with ``hinge``: it scales the hinge's output in place, which autograd refuses.)
- ``aot`` (with ``label_smoothing``) and ``aot_unpaired``: TRL's, on the same four pairs in one batch (both sort
  within a batch), the loss, the rewards and log-probs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")

import datasets  # noqa: E402  (trl depends on both)
import transformers  # noqa: E402
from run_support import TOKENIZER, compose_run, pair_rows  # noqa: E402

from posttune.testing.tiny import tiny_hf_model, tiny_llama_config  # noqa: E402

# transformers 5 renamed gradient checkpointing; TRL 1.16's config still sets the old name
pytestmark = pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing` is deprecated:FutureWarning")

TOL = 1e-6
BETA = 0.5
PAIRS = 4
#: reversal prompts of varied lengths (the batch is padded), chosen the reversal, rejected a copy
WORDS = ["YNBIQP", "KRE", "TQZUWMA", "HELOS"]
CASES = {
    # name: (posttune method settings, TRL DPOConfig settings, pairs per TRL step)
    "dpo": ({"loss_type": "sigmoid"}, {"loss_type": ["sigmoid"]}, PAIRS),
    "ipo": ({"loss_type": "ipo"}, {"loss_type": ["ipo"]}, PAIRS),
    "cdpo": ({"loss_type": "sigmoid", "label_smoothing": 0.2}, {"loss_type": ["aot"], "label_smoothing": 0.2}, 1),
    "hinge": ({"loss_type": "hinge"}, {"loss_type": ["hinge"]}, PAIRS),
    "robust": ({"loss_type": "robust", "label_smoothing": 0.2}, {"loss_type": ["robust"], "label_smoothing": 0.2},
               PAIRS),
    "rpo": ({"loss_type": "sigmoid", "rpo_alpha": 0.5}, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
            1),
    **{name: ({"loss_type": name}, {"loss_type": [name]}, PAIRS)
       for name in ("sigmoid_norm", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down")},
    "exo_pair": ({"loss_type": "exo_pair", "label_smoothing": 1e-3},
                 {"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, PAIRS),
    "discopop": ({"loss_type": "discopop", "discopop_tau": 0.3}, {"loss_type": ["discopop"], "discopop_tau": 0.3},
                 PAIRS),
    # AOT: the batch's log-ratios matched by rank; TRL sorts each step's pairs, so its steps hold all four pairs
    "aot": ({"loss_type": "aot", "label_smoothing": 0.2}, {"loss_type": ["aot"], "label_smoothing": 0.2}, PAIRS),
    "aot_unpaired": ({"loss_type": "aot_unpaired"}, {"loss_type": ["aot_unpaired"]}, PAIRS),
    # WPO: each pair's loss times both responses' length-normalised probabilities against the policy's own
    # distribution (TRL's use_weighting)
    "wpo": ({"loss_type": "sigmoid", "wpo_weights": True}, {"loss_type": ["sigmoid"], "use_weighting": True}, PAIRS),
    # loss lists: MPO's recipe (its sft term as RPO's: one-pair steps), and losses on sums and on means summed
    "mpo": ({"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
            {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}, 1),
    "sigmoid_ipo": ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.3]},
                    {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.3]}, PAIRS),
    # f-DPO: the regulariser's f'(pi / ref) in place of the log-ratios. On padded rows, TRL's layout: forward_kl's
    # exp(-log-ratio) scales the log-ratios' rounding up, and padding-free rows round their matmuls otherwise
    # (5.2e-6 off with forward_kl, 2.4e-6 with alpha_divergence, within 1e-6 padded)
    **{f"f_{kind}": ({"loss_type": "sigmoid", "f_divergence_type": kind, "padding_free": False, **extra},
                     {"loss_type": ["sigmoid"], "f_divergence_type": kind, **extra}, PAIRS)
       for kind, extra in (("forward_kl", {}), ("js_divergence", {}),
                           ("alpha_divergence", {"f_alpha_divergence_coef": 0.3}))},
    "f_hinge": ({"loss_type": "hinge", "f_divergence_type": "js_divergence", "padding_free": False},
                {"loss_type": ["hinge"], "f_divergence_type": "js_divergence"}, PAIRS),
}
#: the loss types whose rewards and log-probs both libraries log alike (log-ratios of token sums)
SUMMED = ("sigmoid", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
          "discopop", "aot", "aot_unpaired")
#: posttune metric -> TRL's logged name, where both log the same quantity (sigmoid losses)
SAME_METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
                "rewards/margin": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
                "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected"}


def conversational_rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Reverse: {word}"}],
             "chosen": [{"role": "assistant", "content": word[::-1]}],
             "rejected": [{"role": "assistant", "content": word}]} for word in WORDS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF Llama (the demo tokenizer's 384 ids) as the reference, and it perturbed as the policy."""
    root = tmp_path_factory.mktemp("dpo_trl")
    config = tiny_llama_config(vocab_size=384, bos_token_id=0, eos_token_id=4, pad_token_id=4)
    model = tiny_hf_model(config, seed=0)
    model.save_pretrained(root / "reference")
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(root / "policy")
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversational_rows()))
    return {"policy": root / "policy", "reference": root / "reference", "data": data}


def run_trl(checkpoints: dict[str, Path], out: Path, settings: dict, batch_size: int,
            rows: list[dict] | None = None) -> tuple[list[dict], list]:
    """A real DPOTrainer run over the rows with learning rate 0: (each step's logs, each step's batch)."""
    batches, steps = [], []

    class Recorder(trl.DPOTrainer):
        """Keeps the collated batch each step scores; the loss itself is TRL's."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            batches.append({key: value.detach().clone() for key, value in inputs.items()})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Logs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:  # a step's log, not the end-of-training summary
                steps.append({**logs, "step": state.global_step})

    load = dict(dtype=torch.float32)
    policy = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["policy"], **load)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["reference"], **load)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    args = trl.DPOConfig(output_dir=str(out), beta=BETA, per_device_train_batch_size=batch_size,
                         max_steps=PAIRS // batch_size, logging_steps=1, learning_rate=0.0, bf16=False, fp16=False,
                         use_cpu=True, max_length=None, gradient_checkpointing=False, report_to="none",
                         save_strategy="no", dataloader_num_workers=0, seed=0, **settings)
    trainer = Recorder(model=policy, ref_model=reference, args=args,
                       train_dataset=datasets.Dataset.from_list(rows or conversational_rows()),
                       processing_class=transformers.AutoTokenizer.from_pretrained(TOKENIZER), callbacks=[Logs()])
    trainer.train()
    for name, param in policy.named_parameters():  # lr 0: every step scored the initial weights
        assert torch.equal(param.detach(), before[name]), name
    assert [entry["step"] for entry in steps] == list(range(1, PAIRS // batch_size + 1))
    return steps, batches


def trl_pairs(batches: list[dict]) -> list[tuple]:
    """Each pair TRL scored: (chosen ids, chosen (position, id) targets, the same for rejected)."""
    pairs = []
    for batch in batches:
        rows = []
        columns = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        for ids, attention, completion in zip(*columns, strict=True):
            length = int(attention.sum())
            assert attention[:length].all()  # right-padded
            ids = ids[:length].tolist()
            rows.append((tuple(ids), tuple((t, ids[t]) for t in range(length) if completion[t])))
        half = len(rows) // 2  # chosen rows, then rejected rows
        pairs += [(*rows[i], *rows[half + i]) for i in range(half)]
    return sorted(pairs)


def posttune_pairs(batch: dict) -> list[tuple]:
    """The same for posttune's batch: labels are pre-shifted, so ``labels[t]`` is the token at t + 1."""
    rows, batch = [], pair_rows(batch)
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        targets = tuple((t + 1, int(labels[t])) for t in range(len(labels)) if labels[t] != -100)
        for position, token in targets:
            assert int(ids[position]) == token
        rows.append((tuple(ids[: targets[-1][0] + 1].tolist()), targets))  # up to the last scored token
    half = len(rows) // 2
    return sorted((*rows[i], *rows[half + i]) for i in range(half))


def dpo_session(checkpoints: dict[str, Path], out: Path, settings: dict, data: Path | None = None,
                fmt: str = "preference") -> Any:
    return compose_run({
        "model": {"path": str(checkpoints["policy"])},
        "reference": {"path": str(checkpoints["reference"])},
        "tokenizer": {"path": TOKENIZER},
        "method": {"name": "dpo", "beta": BETA, **settings},
        "data": {"train": {"path": str(data or checkpoints["data"]), "format": fmt}, "max_seq_len": 64},
        "train": {"epochs": 1, "batch_size": PAIRS, "lr": 1e-3, "seed": 0, "device": "cpu"},
        "checkpoint": {"output_dir": str(out)},
    })


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_loss_equals_trl_dpo_trainer_loss(llama_dpo, checkpoints, tmp_path, case):
    ours_settings, trl_settings, trl_batch = CASES[case]
    session = dpo_session(checkpoints, tmp_path / "out", ours_settings)
    assert {p.dtype for p in session.model.parameters()} == {torch.float32}
    batch = next(iter(session.train_data))
    with torch.no_grad():
        out = session.plan.method.descriptor.loss(session, batch)
    assert float(out.normaliser) == PAIRS
    ours = float(out.loss_sum / out.normaliser)
    metrics = {key: float(total / count) for key, (total, count) in out.metrics.items()}

    logs, batches = run_trl(checkpoints, tmp_path / "trl", trl_settings, trl_batch)
    assert trl_pairs(batches) == posttune_pairs(batch)  # the same tokens, the same ones scored
    theirs = sum(entry["loss"] for entry in logs) / len(logs)  # the mean over pairs: steps hold equal counts

    # f-DPO's regulariser (forward_kl's exp(-log-ratio)) scales the log-ratios' rounding with the loss: relative
    # there (forward_kl's loss of 3.13 measured 1.4e-6 off on an AMD EPYC, within 1e-6 on a Xeon)
    tolerance = TOL * max(1.0, abs(theirs)) if case.startswith("f_") else TOL
    assert math.isfinite(ours) and abs(ours - theirs) <= tolerance, (ours, theirs)
    if case == "hinge":  # not every pair past the margin, where both losses would be 0
        assert ours > 0.1
    if case in ("rpo", "mpo"):  # the NLL term is a real part of the loss
        assert metrics["nll_loss"] > 1.0
    if case == "wpo":  # the weights are far from 1, so an unweighted loss would not pass
        assert metrics["wpo_weight"] < 0.5, metrics["wpo_weight"]
    first = ours_settings["loss_type"] if isinstance(ours_settings["loss_type"], str) else ours_settings["loss_type"][0]
    if first in SUMMED:  # a list logs its first loss's rewards
        # the policy is well off its reference, so a wrong reference or ratio would show
        assert min(abs(metrics["rewards/chosen"]), abs(metrics["rewards/rejected"])) > 0.1
        for key, name in SAME_METRICS.items():
            value = sum(entry[name] for entry in logs) / len(logs)
            # log-probs are sums of ~40 in magnitude, where one fp32 ulp is 3.8e-6: compare them relatively;
            # rewards are beta x differences of such sums (posttune's padding-free row rounds its matmuls
            # unlike TRL's padded rows), so their error scales with the sums, not with the small difference
            scale = abs(value) if key.startswith("logps/") else BETA * abs(metrics["logps/chosen"])
            tolerance = TOL * max(1.0, scale) if key != "rewards/accuracy" else TOL
            assert abs(metrics[key] - value) <= tolerance, (key, metrics[key], value)


def unequal_rows(tmp_path: Path) -> tuple[list[dict], Path]:
    """The rows with rejected responses longer by 0 to 3 tokens' worth of text, or shorter; and their file."""
    rows = conversational_rows()
    for index, row in enumerate(rows):
        word = row["rejected"][0]["content"]
        row["rejected"] = [{"role": "assistant", "content": word + "Q" * index if index % 2 else word[:-1]}]
    data = tmp_path / "unequal.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows, data


def test_ld_dpo_equals_trl_with_responses_of_other_lengths_in_every_layout(llama_dpo, checkpoints, tmp_path):
    """LD-DPO (``ld_alpha``) on pairs whose responses differ in length (the rejected one longer by 0 to 3 tokens'
    worth of text, or shorter): the loss equals a real ``trl.DPOTrainer``'s with ``ld_alpha``, differs from plain
    DPO's, and is the same from padded rows and from padding-free rows with or without the shared prompt."""
    rows, data = unequal_rows(tmp_path)

    def ours(out: str, **settings) -> float:
        session = dpo_session(checkpoints, tmp_path / out, {"loss_type": "sigmoid", **settings}, data)
        batch = next(iter(session.train_data))
        with torch.no_grad():
            result = session.plan.method.descriptor.loss(session, batch)
        return float(result.loss_sum / result.normaliser)

    ld = ours("ld", ld_alpha=0.5)
    logs, _ = run_trl(checkpoints, tmp_path / "trl", {"loss_type": ["sigmoid"], "ld_alpha": 0.5}, PAIRS, rows)
    assert abs(ld - logs[0]["loss"]) <= TOL, (ld, logs[0]["loss"])
    assert abs(ld - ours("plain")) > 1e-3  # the weights change the loss here
    for layout in ({"padding_free": False}, {"share_prompt": False}):
        assert abs(ours(str(layout), ld_alpha=0.5, **layout) - ld) <= TOL, layout
    assert abs(ours("one", ld_alpha=1.0) - ours("plain")) <= TOL  # alpha 1: DPO itself


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_rpo_nll_term_is_not_weighted_by_ld_alpha(llama_dpo, checkpoints, tmp_path, loss_type):
    """RPO with LD-DPO: ``ld_alpha`` weights the log-probs of the preference loss (on token sums, or on per-token
    means for ipo) but not the chosen responses' NLL, as a real ``trl.DPOTrainer``'s sft term (one-pair steps, as
    its sft term is a token mean over the batch). Pairs whose chosen response is the longer one, so that weighting
    its tail would change the NLL."""
    rows, data = unequal_rows(tmp_path)
    session = dpo_session(checkpoints, tmp_path / "out", {"loss_type": loss_type, "rpo_alpha": 0.5, "ld_alpha": 0.5},
                          data)
    with torch.no_grad():
        out = session.plan.method.descriptor.loss(session, next(iter(session.train_data)))
    ours = float(out.loss_sum / out.normaliser)
    logs, _ = run_trl(checkpoints, tmp_path / "trl", {"loss_type": [loss_type, "sft"], "loss_weights": [1.0, 0.5],
                                                      "ld_alpha": 0.5}, 1, rows)
    theirs = sum(entry["loss"] for entry in logs) / len(logs)
    assert abs(ours - theirs) <= TOL * max(1.0, abs(theirs)), (ours, theirs)


#: TRL's standard (plain-text) rows, one dataset with explicit prompts and one with implicit ones (chosen and
#: rejected whole texts sharing their opening, whose final space TRL's prompt split gives to the responses). Half
#: the explicit prompts end with a space that the demo tokenizer merges with the response's "t" (" t"): the encoded
#: prompt is not a prefix of the encoded whole, and the response starts where the two part
STANDARD_ROWS = {
    "explicit": [{"prompt": f"Reverse: {word}\nAnswer:" + " " * (index % 2), "chosen": f"{lead}{word[::-1]}",
                  "rejected": f"{lead}{word}"}
                 for index, word in enumerate(WORDS) for lead in [("the ", " ")[index % 2 == 0]]],
    "implicit": [{"chosen": f"Human: reverse {word}\n\nAssistant: {word[::-1]}",
                  "rejected": f"Human: reverse {word}\n\nAssistant: {word}"} for word in WORDS],
}


@pytest.mark.parametrize("kind", list(STANDARD_ROWS))
def test_standard_text_rows_score_what_trl_scores(llama_dpo, checkpoints, tmp_path, kind):
    """Format ``preference_text`` reads TRL's standard rows as TRL's DPOTrainer does (no chat template; the prompt
    of an implicit row is the shared opening text; EOS after each response; the response starts where the encoded
    prompt and the encoded whole part): the same tokens scored, and the same DPO loss, as a real DPOTrainer."""
    rows = STANDARD_ROWS[kind]
    data = tmp_path / "standard.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    session = dpo_session(checkpoints, tmp_path / "out", {"loss_type": "sigmoid"}, data, fmt="preference_text")
    batch = next(iter(session.train_data))
    with torch.no_grad():
        out = session.plan.method.descriptor.loss(session, batch)
    logs, batches = run_trl(checkpoints, tmp_path / "trl", {"loss_type": ["sigmoid"]}, PAIRS, rows)
    assert trl_pairs(batches) == posttune_pairs(batch)
    ours, theirs = float(out.loss_sum / out.normaliser), logs[0]["loss"]
    assert math.isfinite(ours) and abs(ours - theirs) <= TOL, (ours, theirs)


def trl_orpo() -> tuple[type, Any]:
    """TRL's ORPOTrainer and its ``log1mexp`` (``trl.experimental``: imported without its instability warning)."""
    import warnings

    from trl.import_utils import TRLExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        from trl.experimental.orpo import orpo_trainer
    return orpo_trainer.ORPOTrainer, orpo_trainer.log1mexp


def mean_logps(generator: torch.Generator, count: int) -> torch.Tensor:
    """Per-token mean log-probs from near-certain (-1e-4) to improbable (-12), on both sides of log1mexp's
    switch at -log 2."""
    edges = torch.tensor([-1e-4, -0.01, -0.5, -math.log(2.0), -0.7, -12.0], dtype=torch.float64)
    return torch.cat([edges, -torch.rand(count, generator=generator, dtype=torch.float64) * 6]).float()


def test_orpo_loss_equals_trl_odds_ratio_loss_plus_the_chosen_nll():
    """ORPO on the same random mean log-probs: TRL's ``ORPOTrainer.odds_ratio_loss`` (the method itself, on a
    stand-in trainer holding ``beta``) gives the odds-ratio term and its logged ``log_odds_ratio`` and
    ``log_odds_chosen``; TRL's loss is ``nll - mean(odds-ratio term)``, and posttune's per-pair loss is the
    chosen response's NLL (minus its mean log-prob) minus that term; losses and gradients, fp32."""
    from posttune_dpo.losses import _log1mexp, orpo_log_odds, preference_losses

    ORPOTrainer, log1mexp = trl_orpo()
    generator = torch.Generator().manual_seed(0)
    chosen = mean_logps(generator, 58).requires_grad_()
    rejected = mean_logps(generator, 58).flip(0).requires_grad_()
    beta = 0.25
    stand_in = type("Trainer", (), {"beta": beta, "accelerator": type("Accelerator", (), {"device": "cpu"})()})()

    ours, chosen_rewards, rejected_rewards = preference_losses(chosen, rejected, None, None, loss_type="orpo",
                                                                beta=beta)
    theirs, their_chosen, their_rejected, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        stand_in, chosen, rejected)
    nll = -chosen  # each pair's chosen NLL per token: TRL's nll_loss where every chosen response has one length
    torch.testing.assert_close(ours, nll - theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(chosen_rewards, their_chosen, atol=0, rtol=0)
    torch.testing.assert_close(rejected_rewards, their_rejected, atol=0, rtol=0)
    log_odds = orpo_log_odds(chosen, rejected)
    torch.testing.assert_close(log_odds.mean(), log_odds_chosen, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.nn.functional.logsigmoid(log_odds).mean(), log_odds_ratio, atol=1e-6, rtol=0)

    grads = torch.autograd.grad(ours.mean(), (chosen, rejected))
    their_grads = torch.autograd.grad(nll.mean() - theirs.mean(), (chosen, rejected))
    for got, want in zip(grads, their_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)

    # the paper's log odds, p / (1 - p) with p = exp(mean log-prob), in float64 where it is accurate
    p_chosen, p_rejected = chosen.detach().double().exp(), rejected.detach().double().exp()
    paper = torch.log(p_chosen / (1 - p_chosen)) - torch.log(p_rejected / (1 - p_rejected))
    torch.testing.assert_close(log_odds.detach().double(), paper, atol=1e-4, rtol=1e-5)
    # log(1 - exp(x)) as TRL computes it, near 0 and far from it
    x = torch.cat([torch.linspace(-30, -1e-6, 2001), torch.tensor([-math.log(2.0)])])
    torch.testing.assert_close(_log1mexp(x), log1mexp(x), atol=1e-7, rtol=1e-6)


def test_orpo_stays_finite_for_a_response_of_certain_tokens():
    """A response whose every token has probability ~1 has mean log-prob 0.0 in fp32: log(1 - p) was -inf, so
    ORPO's loss was inf or NaN (TRL's too); its odds term is then saturated, finite and without gradient."""
    from posttune_dpo.losses import preference_losses

    for chosen_value, rejected_value in ((0.0, -2.0), (-2.0, 0.0), (0.0, 0.0)):
        chosen = torch.tensor([chosen_value, -1.0], requires_grad=True)
        rejected = torch.tensor([rejected_value, -3.0], requires_grad=True)
        losses, _, _ = preference_losses(chosen, rejected, None, None, loss_type="orpo", beta=0.1)
        losses.sum().backward()
        assert torch.isfinite(losses).all(), (chosen_value, rejected_value, losses)
        assert torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
