"""``tokenizer.chat_template``: a base model's tokenizer has no chat template; a run names one (a .jinja file or
the template itself), trains chats with it, and saves it with the model, where transformers renders the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import posttune_dpo
import posttune_llama
import pytest
import transformers

from posttune.config import load_config, validate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.training.compose import compose

def session_for(path: Path):
    return compose(resolve_plan(validate(load_config(path, [])), get_registry()))


DEMO_TOKENIZER = Path(posttune_llama.__file__).parent / "demo" / "tokenizer"
CHAT = [{"role": "user", "content": "Reverse: ABC"}, {"role": "assistant", "content": "CBA"}]


@pytest.fixture
def base_tokenizer(tmp_path) -> tuple[Path, str]:
    """The demo tokenizer without its chat template (a base checkpoint's), and that template's text."""
    folder = tmp_path / "base"
    shutil.copytree(DEMO_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, template


def test_a_base_tokenizer_trains_chats_with_a_template_file_and_the_run_saves_it(
        llama_sft, posttune_cli, write_config, base_tokenizer, tmp_path):
    folder, template = base_tokenizer
    without = write_config("without.yaml", tokenizer={"path": str(folder)}, train={"max_steps": 1})
    for command in ("validate", "train"):  # refused before launch, naming what to set (the rows are chats)
        result = posttune_cli(command, str(without))
        assert (result.exit_code, result.stderr) == (2, (
            f"posttune: error: config: tokenizer.path: {folder} has no chat template, and data.train holds chat "
            "messages (a string of a prompt or preference row is one turn): set tokenizer.chat_template (a .jinja "
            "file or the template), or use plain text rows (format text, completion or preference_text)\n"))
    rows = [{"text": f"Reverse: {word} {word[::-1]}"} for word in ("ABC", "QWERT", "XY", "LMNOP")]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = write_config("text.yaml", tokenizer={"path": str(folder)}, train={"max_steps": 1},
                        data={"train": {"path": str(tmp_path / "text.jsonl"), "format": "text"}})
    assert posttune_cli("validate", str(text)).exit_code == 0  # plain text needs no template

    (tmp_path / "chat.jinja").write_text(template)
    path = write_config(tokenizer={"path": str(folder), "chat_template": str(tmp_path / "chat.jinja")},
                        train={"max_steps": 2})
    reference = session_for(write_config("reference.yaml", train={"max_steps": 2}))  # the demo tokenizer, same text
    session = session_for(path)
    assert (next(iter(session.train_data))["input_ids"].tolist()
            == next(iter(reference.train_data))["input_ids"].tolist())
    assert next(iter(session.train_data))["labels"].tolist() == next(iter(reference.train_data))["labels"].tolist()

    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "out" / "model")
    theirs = saved.apply_chat_template(CHAT, tokenize=False)
    assert theirs == (transformers.AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
                      .apply_chat_template(CHAT, tokenize=False))
    assert session.tokenizer.apply_chat_template(CHAT, tokenize=False) == theirs


def test_the_template_itself_may_stand_in_the_config(llama_sft, write_config, base_tokenizer):
    folder, template = base_tokenizer
    session = session_for(write_config(tokenizer={"path": str(folder), "chat_template": template}))
    assert session.tokenizer.chat_template == template


def test_chatml_by_name_renders_chatml_and_warns_where_the_vocabulary_splits_its_markers(
        llama_sft, write_config, base_tokenizer, tmp_path, capsys):
    """axolotl's and unsloth's ``chat_template: chatml``: the template by name. On a tokenizer without ChatML's
    two tokens (the demo's is Llama 3's) it still trains, and says its markers are learnt as text."""
    from posttune.tiny_tokenizer import save_tiny_tokenizer

    chatml = ("<|im_start|>user\nReverse: ABC<|im_end|>\n<|im_start|>assistant\nCBA<|im_end|>\n"
              "<|im_start|>assistant\n")
    folder, _ = base_tokenizer
    session = session_for(write_config(tokenizer={"path": str(folder), "chat_template": "chatml"},
                                       data={"max_seq_len": 256}))
    assert session.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == chatml
    warned = capsys.readouterr().err
    assert "posttune: warning: tokenizer.chat_template writes <|im_end|>, which this tokenizer splits into" in warned
    assert "writes <|im_start|>" in warned
    tiny = save_tiny_tokenizer(tmp_path / "chatml_tokens", template="chatml")
    session = session_for(write_config("own.yaml", tokenizer={"path": str(tiny), "chat_template": "chatml"},
                                       data={"max_seq_len": 256}))
    ids, mask = session.tokenizer.tokenize_messages(CHAT)
    assert "warning" not in capsys.readouterr().err  # its two tokens are the tokenizer's own
    trained = session.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "CBA<|im_end|>"


@pytest.mark.parametrize("value, message", [
    ("missing.jinja", "config: tokenizer.chat_template: no such file 'missing.jinja' (a .jinja file, the template "
                      "itself, or a named one: chatml)"),
    ("tokenizer_default", "config: tokenizer.chat_template: leave it unset (null): the tokenizer's own template is "
                          "the default"),
    ("{% for m in messages %}{{ m.content }}", "config: tokenizer.chat_template: chat template in "
                                                "tokenizer.chat_template: line 1: Unexpected end of template."),
])
def test_a_missing_or_broken_template_is_one_line_from_validate(llama_sft, posttune_cli, write_config, value, message):
    result = posttune_cli("validate", str(write_config(tokenizer={"path": str(DEMO_TOKENIZER),
                                                                  "chat_template": value})))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"posttune: error: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_adapter_run_saves_the_tokenizer_beside_the_adapter_for_generate_and_merge(
        llama_sft, posttune_cli, write_config, base_tokenizer, tmp_path):
    """The base folder has no template, so commands given ``--adapter`` read the one the run saved beside it."""
    folder, template = base_tokenizer
    base_model = tmp_path / "base_model"
    import posttune

    posttune.save_model(posttune.build_model("llama", "tiny", vocab_size=384), base_model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, base_model / name)
    generation = json.loads((base_model / "generation_config.json").read_text())
    (base_model / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [7, 9]}))
    path = write_config(model={"path": str(base_model), "family": None, "size": None, "build_overrides": {}},
                        tokenizer={"path": None, "chat_template": template}, adapter={"rank": 2, "alpha": 4},
                        train={"max_steps": 1})
    assert posttune_cli("train", str(path)).exit_code == 0
    adapter = tmp_path / "out" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "tokenizer.json").is_file()
    # the base's stop tokens travel with the tokenizer read from here (Gemma's <end_of_turn> lives only there)
    assert posttune.load_tokenizer(adapter).eos_ids == posttune.load_tokenizer(base_model).eos_ids
    assert {7, 9} <= set(posttune.load_tokenizer(adapter).eos_ids)
    generated = posttune_cli("generate", "--adapter", str(adapter), "--chat", "--max-new-tokens", "2",
                             "--prompt", "Reverse: AB")
    assert generated.exit_code == 0, generated.stderr
    without = posttune_cli("generate", "--model", str(base_model), "--chat", "--max-new-tokens", "2",
                           "--prompt", "Reverse: AB")
    assert without.exit_code == 2 and "has no chat template" in without.stderr
    assert posttune_cli("merge", "--adapter", str(adapter), "-o", str(tmp_path / "merged")).exit_code == 0
    merged = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert merged.apply_chat_template(CHAT, tokenize=False) == transformers.AutoTokenizer.from_pretrained(
        DEMO_TOKENIZER).apply_chat_template(CHAT, tokenize=False)


def test_a_base_tokenizer_trains_trls_standard_preference_rows_as_text(llama_sft, register_plugin, posttune_cli,
                                                                       write_config, base_tokenizer, tmp_path):
    """DPO on a base model: TRL's standard rows (implicit prompts, as ``Anthropic/hh-rlhf``) as format
    ``preference_text`` need no chat template; format ``preference`` reads strings as chat turns, and refuses
    these before launch, naming the format that reads them (explicit-prompt strings: the text formats)."""
    register_plugin(posttune_dpo, distribution="posttune-dpo", version="0.1.0")
    folder, _ = base_tokenizer
    rows = [{"chosen": f"Human: reverse {word}\n\nAssistant: {word[::-1]}",
             "rejected": f"Human: reverse {word}\n\nAssistant: {word}"} for word in ("ABC", "QWERT", "XY", "LMNOP")]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def config(fmt: str) -> Path:
        return write_config(f"{fmt}.yaml", tokenizer={"path": str(folder)}, method={"name": "dpo"},
                            train={"max_steps": 1, "batch_size": 2},
                            data={"train": {"path": str(tmp_path / "pairs.jsonl"), "format": fmt}})

    refused = posttune_cli("validate", str(config("preference")))
    assert refused.exit_code == 2 and refused.stderr.endswith(
        "(no 'prompt' field, and 'chosen' and 'rejected' are text, not conversations (TRL's standard rows, whose "
        "prompt is their shared opening text: use format preference_text); the row has 'chosen', 'rejected'); "
        "fix the row, or choose the format that matches the data\n")
    (tmp_path / "explicit.jsonl").write_text(json.dumps({"prompt": "Reverse: AB", "chosen": "BA", "rejected": "AB"}))
    explicit = write_config("explicit.yaml", tokenizer={"path": str(folder)}, method={"name": "dpo"},
                            data={"train": {"path": str(tmp_path / "explicit.jsonl"), "format": "preference"}})
    refused = posttune_cli("validate", str(explicit))
    assert refused.exit_code == 2 and refused.stderr.endswith(
        "or use plain text rows (format text, completion or preference_text)\n")
    result = posttune_cli("train", str(config("preference_text")))
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "summary.json").exists()
