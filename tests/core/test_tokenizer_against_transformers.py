"""Tokenizer files read as transformers reads them, each case against `AutoTokenizer` / `GenerationConfig` on the
same folder: a reasoning turn's other spellings, the space clean-up of a word-level tokenizer, stop ids from
generation_config.json, which special-token file wins, `split_special_tokens`; and the refusals at the edges
(an id one past the embedding, a template that reads another name than `tools`)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from posttune import chat_template
from posttune.errors import PosttuneError
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import check_fits, load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("spelling", ["thinking", "reasoning", "reasoning_content"])
def test_a_reasoning_turn_renders_as_transformers_whatever_its_spelling(tmp_path, spelling):
    folder = save_tiny_tokenizer(tmp_path / "tok", template="chatml")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.reasoning_content | default('') }}|{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", spelling: "PLAN", "content": "ok"}]
    ours = load_tokenizer(folder).apply_chat_template(messages, tokenize=False)
    assert ours == transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    assert "PLAN" in ours


def test_a_word_level_tokenizer_decodes_with_transformers_space_clean_up(tmp_path):
    vocab = {word: i for i, word in enumerate(["[UNK]", "I", "do", "n't", "know", ".", "hello", "?"])}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(cleanup=False)
    folder = tmp_path / "words"
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True, "unk_token": "[UNK]"}))
    ids = [1, 2, 3, 4, 5, 6, 7]
    ours = load_tokenizer(folder).decode(ids)
    assert ours == transformers.AutoTokenizer.from_pretrained(folder).decode(ids) == "I don't know. hello?"


@pytest.mark.parametrize("eos", [1, [4, 1]])
def test_stop_ids_of_generation_config_are_transformers(tmp_path, eos):
    folder = save_tiny_tokenizer(tmp_path / "tok")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    theirs = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    assert set(load_tokenizer(folder).eos_ids) >= set(theirs if isinstance(theirs, list) else [theirs])


def test_added_tokens_decoder_wins_over_a_special_tokens_map_as_in_transformers(tmp_path):
    folder = save_tiny_tokenizer(tmp_path / "tok")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    assert load_tokenizer(folder).eos_id == transformers.AutoTokenizer.from_pretrained(folder).eos_token_id


def test_split_special_tokens_encodes_special_text_as_plain_text(tmp_path):
    folder = save_tiny_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    text = "a<|eot_id|>b"
    theirs = transformers.AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)
    assert load_tokenizer(folder).encode(text, add_special_tokens=False) == theirs and len(theirs) > 3


def test_a_token_id_one_past_the_embedding_is_refused(tmp_path):
    folder = save_tiny_tokenizer(tmp_path / "tok")  # ids 0..383
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["384"] = {"content": "<new>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder)
    model = type("Model", (), {"embed": torch.nn.Embedding(385, 4)})()
    check_fits(tokenizer, model, "model")  # 385 rows hold id 384
    model.embed = torch.nn.Embedding(384, 4)
    with pytest.raises(PosttuneError, match="model"):
        check_fits(tokenizer, model, "model")


def test_a_template_that_names_tools_only_inside_another_word_is_refused_tool_definitions():
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(PosttuneError, match="tool definitions"):
        chat_template.check_tool_use("{% for m in messages %}{{ m.content }}{% endfor %}{# tools_list #}",
                                     [{"role": "user", "content": "x"}], tools, "t.jinja")
    chat_template.check_tool_use("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}",
                                 [{"role": "user", "content": "x"}], tools, "t.jinja")
