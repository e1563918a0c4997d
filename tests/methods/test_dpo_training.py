"""DPO runs end to end: validation of preference configs, a precomputed reference, plan and metrics."""

from __future__ import annotations

import math

import posttune_dpo
import pytest
from run_support import check_bundled_config, metrics, write


def test_a_preference_config_trains_with_dpo_and_logs_pair_metrics(llama_dpo, posttune_cli, make_dpo_config,
                                                                   tmp_path):
    config = make_dpo_config(tmp_path, rows=12, train={"epochs": 2, "eval_every": 3})
    config["data"]["validation"] = dict(config["data"]["train"])
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    records = metrics(config["checkpoint"]["output_dir"])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["pairs"] == 4 for r in records)  # the normaliser: pairs, not tokens
    assert all(r["tokens"] > 8 * 4 for r in records)  # what was processed: both responses' tokens
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen",
                "logps/rejected"):
        assert key in records[-1] and f"val_{key}" in records[2]
    assert records[0]["rewards/margin"] == 0.0  # before the first update the policy is its reference
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize("method, logged", [
    ({"name": "dpo", "beta": 0.5, "rpo_alpha": 1.0}, ("nll_loss",)),
    ({"name": "dpo", "loss_type": "orpo", "beta": 0.5}, ("nll_loss", "log_odds_ratio", "log_odds_chosen")),
])
def test_rpo_and_orpo_train_and_log_the_chosen_nll(llama_dpo, posttune_cli, make_dpo_config, tmp_path, method,
                                                   logged):
    """Two epochs of 3 steps: the loss falls (most of it the NLL, which a random model starts at ~log 384 = 6
    per token; measured: by 0.60 with RPO and 0.54 with ORPO, three times the 0.2 asserted), every NLL-related
    metric is logged, for validation too, and finite; ORPO runs with no reference model."""
    config = make_dpo_config(tmp_path, rows=12, method=method, train={"epochs": 2, "eval_every": 3})
    config["data"]["validation"] = dict(config["data"]["train"])
    plan = posttune_cli("plan", str(write(tmp_path, config)))
    assert plan.exit_code == 0, plan.stderr
    assert ("roles        reference:" in plan.stdout) == (method.get("loss_type") != "orpo")
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    records = metrics(config["checkpoint"]["output_dir"])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in logged:
        assert all(math.isfinite(r[key]) for r in records), key
        assert math.isfinite(records[2][f"val_{key}"]) and math.isfinite(records[-1][f"val_{key}"]), key
    assert records[0]["nll_loss"] > 3.0  # a random model: the NLL is most of the loss
    assert records[-1]["loss"] < records[0]["loss"] - 0.2, [r["loss"] for r in records]
    assert records[-1]["val_nll_loss"] < records[2]["val_nll_loss"] - 0.1  # measured: 0.25


def test_with_rpo_accumulation_gives_the_update_of_the_larger_batch(llama_dpo, make_dpo_config, tmp_path):
    """RPO's NLL is per pair (each chosen response's per-token mean), so one step of batch 4 and one of
    batch 2 x accumulation 2 over the same pairs, whose chosen responses differ in length, give the same
    update (SGD, lr 1, no clipping: the update is the gradient)."""
    import torch
    from run_support import compose_run

    from posttune.training.trainer import train

    updates, nll = [], []
    for batch, accumulation in ((4, 1), (2, 2)):
        root = tmp_path / f"{batch}x{accumulation}"
        session = compose_run(make_dpo_config(
            root, rows=8, method={"name": "dpo", "beta": 0.5, "rpo_alpha": 0.5},
            train={"optimizer": "sgd", "lr": 1.0, "max_grad_norm": None, "max_steps": 1, "weight_decay": 0.0,
                   "batch_size": batch, "grad_accum_steps": accumulation}))
        before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
        first = list(session.train_data)[:2]  # a whole epoch, as training will read it again
        lengths = [int((b["labels"] != -100).sum()) for b in first]
        train(session)
        updates.append({n: before[n] - p.detach() for n, p in session.model.named_parameters()})
        nll.append(metrics(root / "out")[0]["nll_loss"])
    assert len(set(lengths)) > 1  # the micro-batches hold different numbers of response tokens
    assert abs(nll[0] - nll[1]) <= 1e-6, nll
    for name, delta in updates[0].items():
        assert float(delta.abs().max()) > 0, name
        torch.testing.assert_close(updates[1][name], delta, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("loss_type", ["sigmoid", ["sigmoid", "ipo"]])  # a list: sums and means, both tabled
def test_precomputed_reference_gives_the_same_per_step_losses_as_a_live_one(llama_dpo, posttune_cli,
                                                                           make_dpo_config, tmp_path, loss_type):
    runs = {}
    for precompute in (False, True):
        config = make_dpo_config(tmp_path / str(precompute), rows=14,
                                 method={"name": "dpo", "beta": 0.5, "precompute_reference": precompute,
                                         "loss_type": loss_type},
                                 train={"epochs": 2, "eval_every": 2})
        config["data"]["validation"] = dict(config["data"]["train"])
        result = posttune_cli("train", str(write(tmp_path, config, f"{precompute}.yaml")))
        assert result.exit_code == 0, result.stderr
        runs[precompute] = metrics(config["checkpoint"]["output_dir"])
    assert len(runs[True]) == len(runs[False]) == 8  # 14 pairs / 4: 4 steps an epoch, the last one partial
    for live, pre in zip(runs[False], runs[True]):
        for key in ("loss", "rewards/margin", "val_loss"):
            if key in live:
                assert abs(pre[key] - live[key]) <= 1e-6, (live["step"], key, pre[key], live[key])


def test_precompute_releases_the_reference_model(llama_dpo, make_dpo_config, tmp_path):
    from run_support import compose_run

    session = compose_run(make_dpo_config(tmp_path, rows=6, method={"name": "dpo", "precompute_reference": True}))
    assert "reference" not in session.models and "reference" not in session.targets
    keys, table = session.method_state["train"][False]  # sigmoid's token sums only
    assert list(session.method_state["train"]) == [False]
    assert keys.tolist() == list(range(6)) and table.shape == (6, 2)


@pytest.mark.parametrize("sections, message", [
    ({"method": "sft"},
     "config: data.train.format: 'preference' gives preference rows; method 'sft' needs conversation rows"),
    ({"data": {"train": {"path": "x.jsonl", "format": "chat"}}},
     "config: data.train.format: 'chat' gives conversation rows; method 'dpo' needs preference rows"),
    ({"data": {"packing": True}}, "config: data.packing: moved: set method.packing"),
    ({"method": {"name": "dpo", "packing": True}},
     "config: method.packing: unknown key (keys: loss_type, loss_weights, beta, label_smoothing, simpo_gamma, "
     "discopop_tau, rpo_alpha, f_divergence_type, f_alpha_divergence_coef, ld_alpha, precompute_reference, "
     "wpo_weights, sync_reference_every, sync_reference_alpha, padding_free, share_prompt)"),
    # TRL's reference-free DPO (a uniform reference) is not offered: the refusal names the losses without one
    ({"method": {"name": "dpo", "reference_free": True}},
     "config: method.reference_free: unknown key; reference_free is method.loss_type: simpo or orpo (losses without a "
     "reference; DPO against a uniform reference is not offered) here"),
    ({"method": {"name": "dpo", "beta": 0}}, "config: method.beta: expected a positive number, got 0.0"),
    ({"method": {"name": "dpo", "loss_type": "aot", "wpo_weights": True}},
     "config: method.wpo_weights: aot sorts the batch's log-ratios, so a pair's loss is not its own to weight (TRL "
     "refuses it too)"),
    # TR-DPO
    ({"method": {"name": "dpo", "sync_reference_every": 0}},
     "config: method.sync_reference_every: expected a number of steps >= 1 (null: a fixed reference), got 0"),
    ({"method": {"name": "dpo", "sync_reference_alpha": 0.5}},
     "config: method.sync_reference_alpha: only sync_reference_every uses it (TR-DPO)"),
    ({"method": {"name": "dpo", "sync_reference_every": 4, "sync_reference_alpha": 0.0}},
     "config: method.sync_reference_alpha: expected a weight in (0, 1], got 0.0"),
    ({"method": {"name": "dpo", "loss_type": "simpo", "sync_reference_every": 4}},
     "config: method.sync_reference_every: simpo uses no reference model; remove it"),
    ({"method": {"name": "dpo", "sync_reference_every": 4, "precompute_reference": True}},
     "config: method.precompute_reference: a reference synced with the policy (sync_reference_every) changes as it "
     "trains; its log-probs cannot be computed once"),
    ({"method": {"name": "dpo", "sync_reference_every": 4}, "adapter": {"rank": 4}},
     "config: method.sync_reference_every: with an adapter the reference shares the policy's base weights; TR-DPO "
     "needs a reference of its own (full fine-tuning, as TRL)"),
    ({"method": {"name": "dpo", "loss_type": "ipo", "label_smoothing": 0.1}},
     "config: method.label_smoothing: ipo has no label smoothing (it is a squared loss); use loss_type sigmoid "
     "for cDPO"),
    ({"method": {"name": "dpo", "label_smoothing": 0.5}},
     "config: method.label_smoothing: expected a value in [0, 0.5), got 0.5"),
    ({"method": {"name": "dpo", "simpo_gamma": 1.0}}, "config: method.simpo_gamma: only loss_type simpo uses it "
                                                      "(this run: sigmoid)"),
    ({"method": {"name": "dpo", "loss_type": "simpo", "precompute_reference": True}},
     "config: method.precompute_reference: simpo uses no reference model; remove it"),
    ({"method": {"name": "dpo", "loss_type": "simpo"}, "models": {"reference": {"family": "llama", "size": "tiny"}}},
     "config: models.reference: method 'dpo' uses no reference model with these settings; remove it"),
    ({"teacher": {"family": "llama", "size": "tiny"}},  # the old spelling of models.teacher
     "config: models.teacher: method 'dpo' uses no teacher model with these settings; remove it"),
    ({"reference": {"family": "qwen3", "size": "0.6b"}},
     "config: models.reference.family: no model family 'qwen3' is installed (installed: llama, mistral, mixtral, "
     "smollm3) — pip install posttune-qwen"),
    ({"reference": {"family": "llama", "size": "tiny"}, "models": {"reference": {"family": "llama", "size": "tiny"}}},
     "config: reference: given twice: `reference:` is the old spelling of `models.reference`; keep one"),
    ({"method": {"name": "dpo", "loss_type": "kto"}},
     "config: method.loss_type: expected one of 'sigmoid', 'ipo', 'simpo', 'hinge', 'robust', 'orpo', 'sigmoid_norm', "
     "'exo_pair', 'nca_pair', 'bco_pair', 'sppo_hard', 'apo_zero', 'apo_down', 'discopop', 'aot', 'aot_unpaired' or a "
     "list, got 'kto'"),
    ({"method": {"name": "dpo", "loss_type": ["sigmoid", "kto"]}},
     "config: method.loss_type[1]: expected one of 'sigmoid', 'ipo', 'simpo', 'hinge', 'robust', 'orpo', "
     "'sigmoid_norm', 'exo_pair', 'nca_pair', 'bco_pair', 'sppo_hard', 'apo_zero', 'apo_down', 'discopop', 'aot', "
     "'aot_unpaired', 'sft', got 'kto'"),
    ({"method": {"name": "dpo", "loss_type": "hinge", "label_smoothing": 0.1}},
     "config: method.label_smoothing: hinge has no label smoothing; loss types sigmoid, simpo, robust, exo_pair, aot, "
     "aot_unpaired use it"),
    ({"method": {"name": "dpo", "loss_type": "orpo", "label_smoothing": 0.1}},
     "config: method.label_smoothing: orpo has no label smoothing; loss types sigmoid, simpo, robust, exo_pair, aot, "
     "aot_unpaired use it"),
    ({"method": {"name": "dpo", "loss_type": "exo_pair"}},
     "config: method.label_smoothing: exo_pair needs it above 0: the labels' epsilon, whose log it takes (the EXO "
     "paper uses 1e-3)"),
    ({"method": {"name": "dpo", "discopop_tau": 0.1}},
     "config: method.discopop_tau: only loss_type discopop uses it (this run: sigmoid)"),
    ({"method": {"name": "dpo", "loss_type": "discopop", "discopop_tau": 0.0}},
     "config: method.discopop_tau: expected a positive number, got 0.0"),
    ({"method": {"name": "dpo", "loss_type": "robust", "label_smoothing": 0.5}},
     "config: method.label_smoothing: expected a value in [0, 0.5), got 0.5"),
    ({"method": {"name": "dpo", "rpo_alpha": -0.5}},
     "config: method.rpo_alpha: expected a positive number (null: no NLL term), got -0.5"),
    ({"method": {"name": "dpo", "rpo_alpha": 0}},
     "config: method.rpo_alpha: expected a positive number (null: no NLL term), got 0.0"),
    ({"method": {"name": "dpo", "loss_type": "orpo", "rpo_alpha": 1.0}},
     "config: method.rpo_alpha: orpo already adds the chosen responses' NLL; remove it"),
    ({"method": {"name": "dpo", "loss_type": "orpo", "precompute_reference": True}},
     "config: method.precompute_reference: orpo uses no reference model; remove it"),
    ({"method": {"name": "dpo", "loss_type": "orpo", "simpo_gamma": 1.0}},
     "config: method.simpo_gamma: only loss_type simpo uses it (this run: orpo)"),
    ({"method": {"name": "dpo", "loss_type": "orpo"}, "models": {"reference": {"family": "llama", "size": "tiny"}}},
     "config: models.reference: method 'dpo' uses no reference model with these settings; remove it"),
    # loss lists (TRL's loss_type list with loss_weights)
    ({"method": {"name": "dpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}},
     "config: method.loss_weights: expected one weight per loss_type (2), got 1"),
    ({"method": {"name": "dpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.0]}},
     "config: method.loss_weights[1]: expected a positive number, got 0.0"),
    ({"method": {"name": "dpo", "loss_weights": [1.0]}},
     "config: method.loss_weights: weights the losses of a loss_type list; this run has one loss (sigmoid): remove "
     "it"),
    ({"method": {"name": "dpo", "loss_type": ["sft"]}},
     "config: method.loss_type: expected at least one pair loss (sigmoid, ipo, ...), got [sft]; sft alone is method "
     "sft"),
    ({"method": {"name": "dpo", "loss_type": ["sigmoid", "ipo", "sigmoid"]}},
     "config: method.loss_type: sigmoid is listed twice; give it one weight in loss_weights"),
    ({"method": {"name": "dpo", "ld_alpha": 1.5}}, "config: method.ld_alpha: expected a weight in [0, 1], got 1.5"),
    ({"method": {"name": "dpo", "loss_type": "ipo", "f_divergence_type": "forward_kl"}},
     "config: method.f_divergence_type: forward_kl replaces the log-ratio difference of sigmoid, hinge, robust, "
     "exo_pair, discopop (this run: ipo)"),
    ({"method": {"name": "dpo", "f_alpha_divergence_coef": 0.3}},
     "config: method.f_alpha_divergence_coef: only f_divergence_type alpha_divergence uses it"),
    ({"method": {"name": "dpo", "loss_type": ["sigmoid", "sft"], "rpo_alpha": 1.0}},
     "config: method.rpo_alpha: loss_type's sft is the same NLL term; keep one of them"),
    ({"method": {"name": "dpo", "loss_type": ["orpo", "sft"]}},
     "config: method.loss_type: orpo already adds the chosen responses' NLL, which sft in the list would add a second "
     "time; remove sft"),
    ({"method": {"name": "dpo", "loss_type": "simpo", "simpo_gamma": -1.0}},
     "config: method.simpo_gamma: expected a margin >= 0, got -1.0"),
    ({"method": {"name": "dpo", "loss_type": ["simpo", "orpo"], "precompute_reference": True}},
     "config: method.precompute_reference: [simpo, orpo] uses no reference model; remove it"),
    ({"method": {"name": "dpo", "loss_type": ["hinge", "ipo"], "label_smoothing": 0.1}},
     "config: method.label_smoothing: [hinge, ipo] has no label smoothing; loss types sigmoid, simpo, robust, "
     "exo_pair, aot, aot_unpaired use it"),
])
def test_impossible_preference_runs_are_refused_by_validate_in_one_line(llama_dpo, posttune_cli, make_dpo_config,
                                                                       tmp_path, sections, message):
    config = make_dpo_config(tmp_path, rows=4)
    for section, values in sections.items():
        config[section] = ({**config[section], **values} if isinstance(values, dict) and
                           isinstance(config.get(section), dict) and section != "method" else values)
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr == f"posttune: error: {message}\n"


def test_plan_lists_the_reference_role_and_its_memory(llama_dpo, posttune_cli, make_dpo_config, tmp_path):
    full = posttune_cli("plan", str(write(tmp_path, make_dpo_config(tmp_path, rows=4))))
    assert full.exit_code == 0, full.stderr
    assert "roles        reference: frozen 'llama' model (random init, size tiny)" in full.stdout
    assert "  reference (frozen, " in full.stdout
    lora = posttune_cli("plan", str(write(tmp_path, make_dpo_config(tmp_path, rows=4, adapter={"rank": 4}))))
    assert "reference: the policy with its adapters disabled (no copy)" in lora.stdout
    assert "  reference: the policy with adapters disabled, no extra memory" in lora.stdout


NAMES = sorted(path.stem for path in posttune_dpo.CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", NAMES)
def test_bundled_configs_validate_and_show_their_command(llama_dpo, register_plugin, posttune_cli, name):
    import posttune_qwen

    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    check_bundled_config(posttune_cli, posttune_dpo.CONFIGS, name)


def test_the_bundled_configs_cover_lora_full_and_the_cpu_example():
    assert {"dpo-tiny-reverse", "llama3.2-1b-dpo-lora", "qwen2.5-0.5b-dpo"} <= set(NAMES)


def test_the_loss_plot_names_what_the_loss_is_averaged_over():
    """The unit is the method's ``LossOutput.unit``, the key the trainer writes after ``tokens``: no table of the
    methods' units in the core (KTO's "examples" read "per unit" before)."""
    from posttune.training.plot import loss_unit

    def record(unit: str) -> dict:
        return {"step": 1, "epoch": 0, "loss": 0.6, "lr": 1e-5, "grad_norm": 1.0, "tokens": 30, unit: 4,
                "tokens_per_s": 9.0, "peak_memory_mib": 1.0, "rewards/margins": 0.1}

    assert [loss_unit(record(unit)) for unit in ("pairs", "labelled_tokens", "examples", "completion_tokens")] == [
        "per pair", "per labelled token", "per example", "per completion token"]
    assert loss_unit({"step": 1, "loss": 2.1}) == "per unit"


def test_tr_dpo_with_alpha_1_makes_every_step_start_from_the_policy_as_its_reference(llama_dpo, posttune_cli,
                                                                                    make_dpo_config, tmp_path):
    """``sync_reference_every: 1, sync_reference_alpha: 1``: after each step the reference becomes the policy, so
    every step's log-ratios are 0 and its loss is log 2 (DPO's at a zero margin); without syncing they are not."""
    def run(name: str, **sync: float) -> list[dict]:
        config = make_dpo_config(tmp_path / name, rows=12, method={"name": "dpo", "beta": 0.5, **sync},
                                 train={"lr": 3e-3})
        result = posttune_cli("train", str(write(tmp_path / name, config)))
        assert result.exit_code == 0, result.stderr
        return metrics(config["checkpoint"]["output_dir"])

    synced, fixed = run("synced", sync_reference_every=1, sync_reference_alpha=1.0), run("fixed")
    assert [r["step"] for r in synced] == [1, 2, 3]
    assert all(r["loss"] == pytest.approx(math.log(2), abs=1e-7) and r["rewards/margin"] == 0.0 for r in synced)
    assert all(abs(r["loss"] - math.log(2)) > 1e-3 for r in fixed[1:])  # the fixed reference falls behind


def test_tr_dpo_moves_the_reference_toward_the_policy_every_n_steps(llama_dpo, make_dpo_config, tmp_path):
    """TR-DPO's soft update, ``ref <- alpha * policy + (1 - alpha) * ref``, at steps that are multiples of
    ``sync_reference_every`` and not between them; a checkpoint keeps the synced reference only once it moved."""
    import torch
    from posttune_dpo import method
    from run_support import compose_run

    session = compose_run(make_dpo_config(tmp_path, rows=6, method={
        "name": "dpo", "sync_reference_every": 2, "sync_reference_alpha": 0.25}))
    reference, policy = session.models["reference"], session.model
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param))
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    session.step = 1
    method.on_step_end(session, {})
    assert all(torch.equal(p, before[name]) for name, p in reference.named_parameters())
    assert method.state_dict(session) is None  # nothing moved: the reference is still its source
    session.step = 2
    method.on_step_end(session, {})
    moved = dict(reference.named_parameters())
    for name, weight in policy.named_parameters():
        torch.testing.assert_close(moved[name], 0.25 * weight + 0.75 * before[name], rtol=0, atol=1e-6)
    assert not torch.equal(moved["layers.0.mlp.down_proj.weight"], before["layers.0.mlp.down_proj.weight"])
    saved = method.state_dict(session)["reference"]
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[name], p) for name, p in reference.named_parameters())


def test_tr_dpo_refuses_a_reference_that_does_not_hold_the_policys_weights(llama_dpo, make_dpo_config, tmp_path):
    from posttune.plugin import ConfigError
    from run_support import compose_run

    config = make_dpo_config(tmp_path, rows=6, method={"name": "dpo", "sync_reference_every": 2})
    config["models"] = {"reference": {"family": "llama", "size": "tiny",
                                      "build_overrides": {"vocab_size": 384, "intermediate_size": 96}}}
    with pytest.raises(ConfigError, match=r"method.sync_reference_every: layers.0.mlp.gate_proj.weight: the other "
                                          r"model holds it as \(\d+, 64\), whole; this one as \(96, 64\), whole; the "
                                          r"models must hold the same weights alike"):
        compose_run(config)


def test_max_seq_len_past_a_frozen_roles_context_is_warned_of(llama_dpo, make_dpo_config, tmp_path, capsys):
    """A reference from another source with a shorter context than ``data.max_seq_len`` (48) would score positions
    it never saw: one warning naming it; the policy's own context (the default, longer) gets none."""
    from run_support import compose_run

    config = make_dpo_config(tmp_path, rows=4)
    config["models"] = {"reference": {"family": "llama", "size": "tiny",
                                      "build_overrides": {"vocab_size": 384, "max_position_embeddings": 40}}}
    compose_run(config)
    assert capsys.readouterr().err == (
        "posttune: warning: data.max_seq_len: 48 is past the reference model's context of 40 tokens "
        "(max_position_embeddings): longer samples use positions it was never trained on; lower it, or extend the "
        "context on purpose (rope scaling in the checkpoint's config)\n")


def test_a_frozen_role_stored_in_bf16_held_in_fp32_is_warned_of(llama_dpo, make_dpo_config, tmp_path, capsys):
    """A reference (or teacher) read from a bf16 checkpoint is held in fp32 by default, twice its size: said, as
    for the trained model (a dtype trial found KD's teacher, the run's largest model, doubled silently)."""
    import torch
    import transformers

    from posttune.testing.tiny import TINY, tiny_hf_model
    from run_support import compose_run

    source = tmp_path / "reference"
    tiny_hf_model(transformers.LlamaConfig(**{**TINY, "vocab_size": 384})).to(torch.bfloat16).save_pretrained(source)
    config = make_dpo_config(tmp_path, rows=4)
    config["models"] = {"reference": {"path": str(source)}}
    compose_run(config)
    assert (f"posttune: warning: models.reference.dtype is fp32 and {source} is stored in bfloat16: the model is "
            "held (frozen) in fp32, twice its size; set models.reference.dtype: bfloat16 to keep bfloat16"
            ) in capsys.readouterr().err
