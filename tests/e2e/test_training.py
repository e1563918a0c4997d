"""`posttune train` end to end on a tiny Llama: full fine-tuning, LoRA, streaming, bad rows, plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from posttune.config import load_config, validate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.training.compose import compose
from posttune.training.metrics import read_metrics as metrics
from posttune.training.trainer import train



def session_for(config_path: Path, *overrides: str):
    plan = resolve_plan(validate(load_config(config_path, list(overrides))), get_registry())
    return compose(plan)


def test_accumulation_gives_the_gradients_of_the_larger_batch(llama_sft, write_config):
    """batch 4 x accumulation 1 == batch 1 x accumulation 4 on sequences of different lengths."""
    path = write_config(train={"optimizer": "sgd", "lr": 1.0, "max_grad_norm": None, "max_steps": 1,
                               "weight_decay": 0.0})
    updates = []
    for batch, accumulation in ((4, 1), (1, 4)):
        session = session_for(path, f"train.batch_size={batch}", f"train.grad_accum_steps={accumulation}")
        before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
        lengths = {int((b["labels"] != -100).sum()) for b in session.train_data}
        train(session)
        updates.append({n: before[n] - p.detach() for n, p in session.model.named_parameters()})
    assert len(lengths) > 1  # the micro-batches really differ in trained tokens
    for name, delta in updates[0].items():
        torch.testing.assert_close(updates[1][name], delta, atol=1e-6, rtol=0, msg=name)


def test_full_fine_tuning_writes_metrics_and_an_hf_checkpoint(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"epochs": 2, "eval_every": 3, "sample_prompts": ["Reverse: ABC"],
                               "sample_max_new_tokens": 4},
                        checkpoint={"save_every": 4, "keep_last": 1})
    result = posttune_cli("train", str(path), f"data.validation.path={tmp_path / 'train.jsonl'}",
                          "data.validation.format=chat")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_memory_mib"} <= set(records[0])
    assert sum(1 for r in records if "val_loss" in r) == 4
    assert records[-1]["loss"] < records[0]["loss"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000012"]  # saves 4, 8 and the last; keeps 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert hf.config.vocab_size == 384
    assert (out / "model" / "tokenizer.json").is_file()
    assert "before:" in result.stdout and "after:" in result.stdout
    assert json.loads((out / "summary.json").read_text())["final_step"] == 12
    run = json.loads((out / "run.json").read_text())  # what an operator reads: how it ended, where and how it ran
    assert (run["status"], run["step"], run["pid"]) == ("finished", 12, os.getpid()) and run["ended"] >= run["started"]
    generated = posttune_cli("generate", "--model", str(out / "model"), "--prompt", "Reverse: ABC", "--chat")
    assert generated.exit_code == 0, generated.stderr


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapter_run_saves_a_peft_adapter_and_the_merged_model(llama_sft, posttune_cli, write_config, tmp_path,
                                                              kind):
    path = write_config(adapter={"kind": kind, "rank": 4, "alpha": 8}, train={"max_steps": 3, "lr": 1e-2},
                        checkpoint={"save_merged": True})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    adapter = tmp_path / "out" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert config["use_dora"] is (kind == "dora")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert merged.config.vocab_size == 384


def test_streaming_dataset_trains(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(train={"max_steps": 4}, data={"train": {"path": str(tmp_path / "train.jsonl"),
                                                                 "format": "chat", "streaming": True}})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    assert [r["step"] for r in metrics(tmp_path / "out")] == [1, 2, 3, 4]


def test_prompt_completion_rows_validate_and_train(llama_sft, posttune_cli, write_config, tmp_path):
    """TRL's prompt-completion text rows (no chat template needed): the completion trains, so each row's
    labelled tokens are its completion's and EOS, a fixed count per row here."""
    rows = [{"prompt": f"Reverse: {word}\nAnswer:", "completion": f" {word[::-1]}"} for word in ("ABC", "XYZW")]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 4))
    path = write_config(train={"max_steps": 2, "batch_size": 8},
                        data={"train": {"path": str(tmp_path / "pc.jsonl"), "format": "completion"}})
    assert posttune_cli("validate", str(path)).exit_code == 0
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    first = metrics(tmp_path / "out")[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "model")
    completion = [len(tokenizer(r["prompt"] + r["completion"])["input_ids"]) - len(tokenizer(r["prompt"])["input_ids"])
                  + 1 for r in rows]  # the completion's tokens and EOS
    assert first["labelled_tokens"] == 4 * sum(completion)


def test_streaming_without_max_steps_is_refused(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config(data={"train": {"path": str(tmp_path / "train.jsonl"), "format": "chat", "streaming": True}})
    result = posttune_cli("train", str(path))
    assert result.stderr == ("posttune: error: config: train.max_steps: required with streaming data "
                             "(the epoch length is unknown)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_run_without_a_gpu_is_one_line_before_the_output_dir_is_touched(llama_sft, posttune_cli,
                                                                                write_config, tmp_path):
    """`validate` cannot know the machine that will train (a laptop checks a GPU run); the launch can."""
    path = write_config()
    assert posttune_cli("validate", str(path), "train.device=cuda").exit_code == 0
    result = posttune_cli("train", str(path), "train.device=cuda")
    assert (result.exit_code, result.stderr) == (2, "posttune: error: config: train.device cuda: no CUDA device is "
                                                    "available here (use cpu or auto)\n")
    assert {path.name for path in (tmp_path / "out").glob("*")} <= {".posttune.lock"}  # no config, no weights


def test_an_unknown_build_override_is_named_in_one_line(llama_sft, posttune_cli, write_config):
    path = write_config(model={"build_overrides": {"vocab_size": 384, "hiden_size": 32}})
    # refused before launch (the family's builder takes no **kwargs), by train and plan alike, with a suggestion
    for command in ("train", "plan"):
        result = posttune_cli(command, str(path))
        assert result.exit_code == 2
        assert len(result.stderr.splitlines()) == 1
        assert result.stderr.startswith("posttune: error: config: model.build_overrides.hiden_size: family 'llama' "
                                        "(posttune-llama 0.1.0) builds with no argument 'hiden_size' (did you mean "
                                        "'hidden_size'?) (arguments: vocab_size, hidden_size, ")


@pytest.mark.parametrize("value, words", [
    ("two", "builds with num_layers: expected an integer, got 'two'"),  # a TypeError traceback from the build
    (2.5, "builds with num_layers: expected an integer, got 2.5"),
    (-1, "builds with num_layers: expected a non-negative integer, got -1"),
    (0, "builds with num_layers: expected a positive integer, got 0"),  # trained, then refused by every reader
])
def test_a_build_override_of_the_wrong_type_is_refused_by_validate(llama_sft, posttune_cli, write_config, value,
                                                                   words):
    path = write_config(model={"build_overrides": {"vocab_size": 384, "num_layers": value}})
    result = posttune_cli("validate", str(path))
    assert (result.exit_code, result.stderr) == (2, "posttune: error: config: model.build_overrides.num_layers: "
                                                    f"family 'llama' {words}\n")


def test_a_whole_float_build_override_reaches_the_build_as_an_integer(llama_sft, posttune_cli, write_config):
    """YAML's ``1.0`` for a layer count is read as a config field's integer is, not passed on to ``range``."""
    path = write_config(model={"build_overrides": {"vocab_size": 384, "num_layers": 1.0}}, train={"max_steps": 1})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr


def test_heads_an_override_cannot_group_are_refused_by_validate_plan_and_train(llama_sft, posttune_cli, write_config,
                                                                              tmp_path):
    path = write_config(model={"build_overrides": {"vocab_size": 384, "num_heads": 5}})
    for command in ("validate", "plan", "train"):  # the config.json the run would save says it before any build
        result = posttune_cli(command, str(path))
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr == ("posttune: error: config: model.build_overrides: the config.json it saves: "
                                 "num_attention_heads: 5 is not a multiple of num_key_value_heads (2)\n")


@pytest.mark.parametrize(("overrides", "words"), [
    ({"head_dim": 0}, "model.build_overrides.head_dim: family 'llama' builds with head_dim: expected a positive "
                      "integer, got 0"),  # the builder read 0 as its default: a silently different model
    ({"rope_theta": -1}, "model.build_overrides: the config.json it saves: rope_theta: expected a positive number or "
                         "null, got -1.0"),
])
def test_an_override_the_saved_checkpoint_would_not_load_with_is_refused_by_validate(llama_sft, posttune_cli,
                                                                                     write_config, overrides, words):
    path = write_config(model={"build_overrides": {"vocab_size": 384, **overrides}})
    result = posttune_cli("validate", str(path))
    assert (result.exit_code, result.stderr) == (2, f"posttune: error: config: {words}\n")


def test_empty_responses_are_counted_and_said(llama_sft, posttune_cli, write_config, tmp_path):
    """A CSV's empty answer cell is "" (not a missing field): such a row trains only its end token, teaching the
    model to answer with nothing. It still trains, as in TRL, but the banner and the summary say how many."""
    path = write_config(train={"max_steps": 1})
    rows = (tmp_path / "train.jsonl").read_text().splitlines()
    for index in (2, 7):
        row = json.loads(rows[index])
        row["messages"][1]["content"] = " " if index == 7 else ""
        rows[index] = json.dumps(row)
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    assert "(2 samples with an empty response)" in result.stdout
    assert ("data: 2 sample(s) with an empty or blank response trained little more than the end token (they teach "
            "the model to answer with nothing): drop or fill those rows") in result.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["empty_responses"] == 2


def test_long_documents_split_into_pieces_train_and_are_counted(llama_sft, posttune_cli, write_config, tmp_path):
    """Continued pretraining: ``method.long_samples: split`` keeps a long document whole, in pieces (the data
    toolkit's test checks the tokens); a streamed dataset is refused before launch, naming the dataset."""
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": "lorem ipsum " * n}) + "\n" for n in (1, 40, 2)))
    data = {"train": {"path": str(tmp_path / "docs.jsonl"), "format": "text"}, "max_seq_len": 32}
    path = write_config(data=data, method={"name": "sft", "packing": True, "long_samples": "split"},
                        train={"max_steps": 1})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    assert "(1 sample split into pieces of data.max_seq_len)" in result.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["split_samples"] == 1
    streamed = write_config("streamed.yaml", data={**data, "train": {**data["train"], "streaming": True}},
                            method={"name": "sft", "long_samples": "split"}, train={"max_steps": 1})
    result = posttune_cli("validate", str(streamed))
    assert (result.exit_code, result.stderr) == (2, "posttune: error: config: method.long_samples: split needs "
                                                    "map-style data: data.train is streamed (a streamed row's "
                                                    "pieces could straddle a checkpoint)\n")


def test_a_log_file_gets_no_bar_frame_per_evaluation(llama_sft, posttune_cli, write_config, tmp_path):
    """Off a terminal the bar draws a frame every 30 s: an evaluation's forced refresh and its line (tqdm.write
    redraws the bar below it) added two frames each, hundreds in a batch job's log with a frequent eval_every."""
    path = write_config(data={"validation": {"path": str(tmp_path / "train.jsonl"), "format": "chat"}},
                        train={"max_steps": 6, "eval_every": 1})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("val_loss") >= 6  # each evaluation's line, on stdout
    assert "eval:" not in result.stderr and result.stderr.count("train:") <= 2, result.stderr


def test_training_in_fp16_is_refused_before_launch(llama_sft, posttune_cli, write_config):
    """Pure fp16 training (no loss scaling, AdamW's state in fp16) went to NaN within 4 steps where bf16 and fp32
    trained (a dtype trial); it warned before. torchtune refuses it too. Frozen models may be fp16."""
    for command in ("validate", "train"):
        result = posttune_cli(command, str(write_config(model={"dtype": "fp16"}, train={"max_steps": 1})))
        assert result.exit_code == 2
        assert result.stderr == ("posttune: error: config: model.dtype: fp16 weights cannot train here: with no loss "
                                 "scaling and AdamW's state in fp16, small gradients underflow and the run diverges "
                                 "(NaN within a few steps); use bf16, or fp32 on a GPU without bf16 (fp16 suits "
                                 "frozen models: models.<role>.dtype, and generate)\n")


def test_bad_row_is_named_in_one_line(llama_sft, posttune_cli, write_config, tmp_path):
    path = write_config()
    rows = (tmp_path / "train.jsonl").read_text().splitlines()
    rows[5] = json.dumps({"message": []})
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    result = posttune_cli("train", str(path))
    assert result.exit_code == 2
    assert result.stderr.startswith("posttune: error: data.train: row 5: missing field 'messages'")
    assert result.stderr.count("\n") == 1
    skipped = posttune_cli("train", str(path), "data.skip_bad_rows=true", "train.max_steps=1")
    assert skipped.exit_code == 0, skipped.stderr
    assert ("skipped 1 bad row(s) (the first: data.train: row 5: missing field 'messages' (absent or null))"
            in skipped.stdout)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["skipped_bad_rows"] == 1 and "truncated_samples" not in summary  # counts, where there are any
    assert summary["first_skipped_row"] == "data.train: row 5: missing field 'messages' (absent or null)"


def test_plot_writes_a_png_of_the_losses(llama_sft, posttune_cli, write_config, tmp_path):
    pytest.importorskip("matplotlib", reason="posttune plot needs the optional matplotlib extra")
    path = write_config(train={"max_steps": 3})
    assert posttune_cli("train", str(path)).exit_code == 0
    png = tmp_path / "custom.png"
    result = posttune_cli("plot", str(tmp_path / "out"), "--out", str(png))
    assert result.exit_code == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "loss.png").is_file()  # written at the end of training too


@pytest.mark.parametrize("method, panels", [("grpo", 2), ("sft", 1), ("not-installed", 1)])
def test_plot_draws_the_panels_the_run_s_method_names(register_plugin, posttune_cli, tmp_path, method, panels):
    """GRPO's ``plot=("reward",)`` adds a reward panel (the core names no method's metric); a method that is not
    installed leaves the loss alone. Each panel is 400 pixels high."""
    pytest.importorskip("matplotlib", reason="posttune plot needs the optional matplotlib extra")
    import posttune_grpo
    import posttune_sft

    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    records = [{"step": s, "loss": 1.0 / s, "tokens": 10, "completions": 4, "reward": 0.1 * s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.yaml").write_text(f"method:\n  name: {method}\n")
    result = posttune_cli("plot", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    assert int.from_bytes((tmp_path / "loss.png").read_bytes()[20:24], "big") == 400 * panels


def test_plot_of_a_folder_without_metrics_is_one_line(posttune_cli, tmp_path):
    result = posttune_cli("plot", str(tmp_path))
    assert result.exit_code == 2 and "no metrics.jsonl" in result.stderr


def test_max_seq_len_past_the_model_context_is_warned_of_once(llama_sft, posttune_cli, write_config):
    """A model with a context of 256 positions: a longer max_seq_len trains positions it never saw (allowed, as
    RoPE allows it; a warning), 256 gets none."""
    model = {"build_overrides": {"vocab_size": 384, "max_position_embeddings": 256}}
    past = posttune_cli("train", str(write_config("past.yaml", model=model, data={"max_seq_len": 300},
                                                  train={"max_steps": 1})))
    assert past.exit_code == 0, past.stderr
    warning = ("posttune: warning: data.max_seq_len: 300 is past the model's context of 256 tokens "
               "(max_position_embeddings): longer samples use positions it was never trained on; lower it, or "
               "extend the context on purpose (rope scaling in the checkpoint's config)\n")
    assert past.stderr.count(warning) == 1
    within = posttune_cli("train", str(write_config("within.yaml", model=model, data={"max_seq_len": 256},
                                                    train={"max_steps": 1}, checkpoint={"overwrite": True})))
    assert within.exit_code == 0 and "data.max_seq_len" not in within.stderr
    # a user who never set it is told the figure is the default
    unset = posttune_cli("train", str(write_config("unset.yaml", model=model, train={"max_steps": 1},
                                                   checkpoint={"overwrite": True})), "~data.max_seq_len")
    assert unset.exit_code == 0, unset.stderr
    assert ("posttune: warning: data.max_seq_len: 2048 (the default when not set) is past the model's context of 256"
            in unset.stderr)


@pytest.mark.parametrize(("scaling", "max_seq_len", "after"), [
    ({"rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": [1.0] * 8,
      "long_factor": [2.0] * 8}, 48, 32),
    ({"rope_type": "dynamic", "factor": 2.0}, 300, 256),
    ({"rope_type": "dynamic", "factor": 2.0}, 256, None),
])
def test_rope_that_grows_with_the_length_warns_that_a_forwards_documents_share_it(
        llama_sft, write_config, capsys, scaling, max_seq_len, after):
    """Dynamic NTK and LongRoPE pick frequencies by a forward's longest position: past the switch, documents packed
    or batched with a longer one train under its frequencies (measured: a packed Phi-3 val_loss 7.819 against 7.887
    alone), so the run says so; within it nothing changes and nothing is said."""
    from posttune.config import load_config, validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training.compose import compose

    model = {"build_overrides": {"vocab_size": 384, "max_position_embeddings": 256, "rope_scaling": scaling}}
    path = write_config(model=model, data={"max_seq_len": max_seq_len}, train={"max_steps": 1})
    compose(resolve_plan(validate(load_config(path, [])), get_registry()))
    warned = [line for line in capsys.readouterr().err.splitlines() if "RoPE scaling changes" in line]
    if after is None:
        assert warned == []
    else:
        assert warned == [f"posttune: warning: data.max_seq_len: {max_seq_len} is past the {after} positions where "
                          f"the model's {scaling['rope_type']} RoPE scaling changes its frequencies: documents sharing "
                          "a forward (a batch, a packed or padding-free row) all take those of the longest one (as "
                          "transformers' padded batches do); train.batch_size 1 without packing keeps each "
                          "document's own"]


def test_trained_model_keeps_the_checkpoints_generation_config(llama_sft, posttune_cli, make_config, tmp_path):
    """Stop ids and sampling defaults of generation_config.json survive training (transformers' and vLLM's
    generate read them): the saved file is the source's, not one derived from config.json."""
    import yaml

    from posttune.testing.tiny import TINY, tiny_hf_model

    source = tmp_path / "base"
    tiny_hf_model(transformers.LlamaConfig(**{**TINY, "vocab_size": 384})).save_pretrained(source)
    wanted = {"do_sample": True, "eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}
    (source / "generation_config.json").write_text(json.dumps(wanted))
    config = make_config(tmp_path, train={"max_steps": 1})
    config["model"] = {"path": str(source)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(tmp_path / "run.yaml"))
    assert result.exit_code == 0, result.stderr
    saved = json.loads((tmp_path / "out" / "model" / "generation_config.json").read_text())
    assert {key: saved.get(key) for key in wanted} == wanted


def test_an_fp32_run_on_a_bf16_checkpoint_warns_that_it_saves_fp32(llama_sft, posttune_cli, make_config, tmp_path):
    """transformers keeps a checkpoint's dtype; posttune trains in model.dtype (fp32 by default), so a bf16
    checkpoint comes back twice its size unless model.dtype says bf16: said before training."""
    import yaml

    from posttune.testing.tiny import TINY, tiny_hf_model

    source = tmp_path / "base"
    tiny_hf_model(transformers.LlamaConfig(**{**TINY, "vocab_size": 384})).to(torch.bfloat16).save_pretrained(source)
    config = make_config(tmp_path, train={"max_steps": 1})
    config["model"] = {"path": str(source)}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(tmp_path / "run.yaml"))
    assert result.exit_code == 0, result.stderr
    assert (f"posttune: warning: model.dtype is fp32 and {source} is stored in bfloat16: the model trains and is "
            "saved in fp32, twice its size; set model.dtype: bfloat16 to keep bfloat16") in result.stderr
    kept = posttune_cli("train", str(tmp_path / "run.yaml"), "model.dtype=bf16", "checkpoint.overwrite=true")
    assert kept.exit_code == 0 and "is stored in" not in kept.stderr
    assert json.loads((tmp_path / "out" / "model" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_run_that_fails_while_composing_records_failed_in_run_json(llama_sft, posttune_cli, write_config, tmp_path):
    """A checkpoint that fails to load (a truncated safetensors file): run.json said ``running`` afterwards, so a
    watcher took the run for alive; it says ``failed`` with the error line, and no step (none ran)."""
    import posttune

    base = tmp_path / "base"
    posttune.save_model(posttune.build_model("llama", "tiny", vocab_size=384), base)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    path = write_config(model={"path": str(base), "family": None, "size": None, "build_overrides": {}},
                        train={"max_steps": 1})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 2, result.stderr
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["status"] == "failed" and "step" not in run
    assert result.stderr.rstrip().endswith(run["error"])


def test_a_model_path_not_written_yet_is_valid_with_a_warning(llama_sft, posttune_cli, write_config, tmp_path):
    """A warm start an earlier step writes: the config is valid, but train needs the folder; validate and plan say
    so (with the family named, nothing else reads the path before the run)."""
    path = write_config(model={"path": str(tmp_path / "warm" / "model"), "family": "llama"})
    for command in ("validate", "plan"):
        result = posttune_cli(command, str(path), "--no-estimate") if command == "plan" else \
            posttune_cli(command, str(path))
        assert result.exit_code == 0, result.stderr
        assert result.stderr == (f"posttune: warning: model.path: no checkpoint at {tmp_path / 'warm' / 'model'} yet: "
                                 "train needs it (an earlier step writes it?)\n")
    result = posttune_cli("train", str(path))
    assert result.exit_code == 2
    assert result.stderr.endswith(f"{tmp_path / 'warm' / 'model'}: no such checkpoint directory\n")
    result = posttune_cli("train", str(path), "tokenizer.path=null")  # read from the model's folder: named as it
    assert result.stderr.endswith(f"config: model.path: {tmp_path / 'warm' / 'model'}: no such checkpoint directory\n")


def test_sigterm_while_the_run_is_prepared_is_recorded_and_exits_143(llama_sft, posttune_cli, write_config, tmp_path,
                                                                     monkeypatch):
    """Before step 1 there is nothing to save; the default SIGTERM would kill the process with run.json saying
    "running". Now the run says so, records "preempted" and exits as a preempted run does."""
    import os
    import signal

    from posttune.training import compose

    def loading(session):
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's SIGTERM while the weights load
        raise AssertionError("the signal did not stop setup")

    monkeypatch.setattr(compose, "build_policy", loading)
    before = signal.getsignal(signal.SIGTERM)
    result = posttune_cli("train", str(write_config()))
    assert result.exit_code == 143, result.stderr
    assert result.stderr.endswith("posttune: SIGTERM while the run was being prepared: no step ran, so no checkpoint "
                                  "was written; start it again (a resumed run resumes from the same checkpoint)\n")
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "preempted"
    assert signal.getsignal(signal.SIGTERM) == before

    # a worker of posttune's launcher: torchrun sends the same SIGTERM to the healthy ranks when one fails, so the
    # note goes to the rank's error file; the launcher prints it only for a job that was stopped
    from posttune.cli.launch import REPORTS

    monkeypatch.setenv(REPORTS, "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    result = posttune_cli("train", str(write_config(checkpoint={"output_dir": str(tmp_path / "worker")})))
    assert result.exit_code == 143 and "being prepared" not in result.stderr, result.stderr
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert recorded.startswith("StoppedInSetup: SIGTERM while the run was being prepared: no step ran")
    assert json.loads((tmp_path / "worker" / "run.json").read_text())["status"] == "preempted"


def test_resume_latest_refuses_a_finished_run_with_no_checkpoint(llama_sft, posttune_cli, write_config, tmp_path):
    """No save_every: nothing to continue from. `latest` started again at step 0 and replaced the finished model,
    metrics and summary; validate said valid."""
    path = write_config(train={"max_steps": 2})
    assert posttune_cli("train", str(path)).exit_code == 0
    model = (tmp_path / "out" / "model" / "model.safetensors").read_bytes()
    for command in ("validate", "train"):
        result = posttune_cli(command, str(path), "checkpoint.resume=latest", "train.max_steps=4")
        assert result.exit_code == 2, result.stdout
        assert result.stderr == (f"posttune: error: config: checkpoint.resume: latest: {tmp_path / 'out'} holds a "
                                 "finished run with no checkpoint to continue from (checkpoint.save_every was unset, "
                                 "or keep_last pruned them all): restart it with checkpoint.overwrite=true, or train "
                                 "into another output_dir from its model\n")
    assert (tmp_path / "out" / "model" / "model.safetensors").read_bytes() == model


def test_overwrite_by_an_adapter_run_removes_the_full_runs_model(llama_sft, posttune_cli, write_config, tmp_path):
    """The new run writes adapter/ only: the old model/ stayed beside it, a stale model from another run."""
    path = write_config(train={"max_steps": 1})
    assert posttune_cli("train", str(path)).exit_code == 0
    result = posttune_cli("train", str(path), "checkpoint.overwrite=true", "adapter.rank=2", "adapter.alpha=4")
    assert result.exit_code == 0, result.stderr
    assert "removing the previous run's metrics.jsonl, loss.png, summary.json, model from" in result.stdout
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "out" / "model").exists()
