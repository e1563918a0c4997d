"""posttune.tokenizer gives transformers' ids, texts and chat renderings on the same files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from posttune.errors import PosttuneError
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import Tokenizer, load_tokenizer
from transformers import AutoTokenizer

STYLES = ("llama3", "chatml", "start_of_turn")
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "start_of_turn": "<end_of_turn>"}

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand   runs     of spaces",
    "日本語のテキスト。中文文本。한국어",
    "emoji 🙂🚀👍🏽 and a family 👨‍👩‍👧",
    "Café naïve résumé über señor Ωμέγα",
    "code: def f(x):\n    return {'a': [1, 2]}\n",
    "special <|eot_id|> tokens <|im_start|>inside<|im_end|> text <bos><end_of_turn>",
    "<|begin_of_text|>starts with a special token",
]

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 日本 🙂?"},
    {"role": "assistant", "content": "  Spaces, then\ttabs.\n"},
]
PLAIN_CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say OK."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str | None, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: save_tiny_tokenizer(root / str(style), template=style) for style in (*STYLES, None)}


def both(folder: Path) -> tuple[Tokenizer, object]:
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


def chatml_with(folders, tmp_path, template: str):
    """The chatml tokenizer with ``template`` as its chat template: (ours, transformers')."""
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, chat_template=template)
    return both(folder)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# -- encode / decode ------------------------------------------------------------------------------

@pytest.mark.parametrize("style", (*STYLES, None))
def test_encode_matches_transformers(folders, style):
    ours, theirs = both(folders[style])
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("style", (*STYLES, None))
def test_decode_matches_transformers(folders, style):
    ours, theirs = both(folders[style])
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text


def test_decode_takes_tensors(folders):
    import torch

    ours = load_tokenizer(folders["chatml"])
    ids = ours.encode("tensor 🙂")
    assert ours.decode(torch.tensor(ids)) == ours.decode(ids) == "tensor 🙂"


def test_hub_id_downloads_only_tokenizer_files(folders, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(folders["chatml"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert load_tokenizer("org/tiny-chat").encode("hi") == load_tokenizer(folders["chatml"]).encode("hi")
    repo_id, patterns = calls[0]
    assert repo_id == "org/tiny-chat" and "tokenizer.json" in patterns
    assert not any("safetensors" in p or p == "*" for p in patterns)


def test_hub_failure_is_one_line(monkeypatch):
    import huggingface_hub

    def offline(repo_id, allow_patterns):
        raise OSError("no network\nat all")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert "could not download 'org/missing'" in one_line_error(load_tokenizer, "org/missing")


def test_special_token_ids_and_pad_falls_back_to_eos(folders):
    llama, chatml = load_tokenizer(folders["llama3"]), load_tokenizer(folders["chatml"])
    hf = AutoTokenizer.from_pretrained(folders["llama3"])
    assert (llama.bos_id, llama.eos_id, llama.eos_ids) == (hf.bos_token_id, hf.eos_token_id, [hf.eos_token_id])
    assert hf.pad_token_id is None and llama.pad_id == llama.eos_id
    assert chatml.bos_id is None and chatml.pad_id == chatml.backend.token_to_id("<|endoftext|>")
    assert llama.vocab_size == len(hf) == 384


def test_generation_config_adds_stop_tokens(folders, tmp_path):
    folder = copy_of(folders["llama3"], tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    assert load_tokenizer(folder).eos_ids == [4, 1]
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))  # read only without the file above
    assert load_tokenizer(folder).eos_ids == [4, 1]
    (folder / "generation_config.json").unlink()  # transformers falls back to config.json's ids: so do its stops
    assert load_tokenizer(folder).eos_ids == [4, 2]


def test_tokens_missing_from_tokenizer_json_are_added_like_transformers(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, bos_token="<|newbos|>", extra_special_tokens=["<|tool|>"])
    ours, theirs = both(folder)
    text = "a <|newbos|> b <|tool|> c"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.bos_id == theirs.bos_token_id and ours.vocab_size == len(theirs)


def test_add_bos_token_in_config_is_ignored_when_tokenizer_json_exists(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, bos_token="<|endoftext|>", add_bos_token=True, add_eos_token=True)
    ours, theirs = both(folder)
    assert ours.encode("hi") == theirs.encode("hi") == ours.encode("hi", add_special_tokens=False)


def test_legacy_special_tokens_map_is_read_without_added_tokens_decoder(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, added_tokens_decoder=None, eos_token="<|endoftext|>")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    ours, theirs = both(folder)
    assert ours.eos_id == theirs.eos_token_id == ours.backend.token_to_id("<|im_end|>")


# -- chat templates -------------------------------------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("chat", [SYSTEM_CHAT, PLAIN_CHAT], ids=["system-multi-turn", "no-system"])
@pytest.mark.parametrize("prompt", [False, True], ids=["", "generation-prompt"])
def test_chat_template_matches_transformers(folders, style, chat, prompt):
    ours, theirs = both(folders[style])
    text = theirs.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == text
    ids = theirs.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == ids


def test_rendered_chat_is_not_given_a_second_bos(folders):
    ours = load_tokenizer(folders["llama3"])
    ids = ours.apply_chat_template(PLAIN_CHAT)
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_tools_and_template_kwargs_match_transformers(folders, style):
    ours, theirs = both(folders[style])
    expected = theirs.apply_chat_template(PLAIN_CHAT, tools=TOOLS, tokenize=False, custom="x")
    assert ours.apply_chat_template(PLAIN_CHAT, tools=TOOLS, tokenize=False, custom="x") == expected
    assert "<two>" in expected  # tojson does not HTML-escape


def test_template_helpers_match_transformers(folders, tmp_path):
    ours, theirs = chatml_with(folders, tmp_path, (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }} {{ strftime_now('%Y') }} {{ {'k': '<é>'} | tojson }} {{ dict(a=1) | tojson }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ eos_token }}"))
    assert ours.apply_chat_template(PLAIN_CHAT, tokenize=False) == theirs.apply_chat_template(
        PLAIN_CHAT, tokenize=False)


def test_chat_template_jinja_file_wins_over_config(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    ours, theirs = both(folder)
    assert ours.apply_chat_template(PLAIN_CHAT, tokenize=False) == theirs.apply_chat_template(
        PLAIN_CHAT, tokenize=False) == "[user]Hi[assistant]Hello! How can I help?[user]Say OK."


def test_named_templates_pick_tool_use_when_tools_are_given(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, chat_template=[{"name": "default", "template": "plain"},
                                       {"name": "tool_use", "template": "tools: {{ tools | length }}"}])
    ours, theirs = both(folder)
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(PLAIN_CHAT, tools=tools, tokenize=False) == theirs.apply_chat_template(
            PLAIN_CHAT, tools=tools, tokenize=False)


def test_none_fields_are_dropped_before_rendering(folders):
    ours, theirs = both(folders["chatml"])
    chat = [{"role": "user", "content": "Hi", "tool_calls": None}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)


# -- assistant masks ------------------------------------------------------------------------------

def trained_pieces(tokenizer: Tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded runs of trained tokens, in order."""
    runs, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run) for run in runs]


@pytest.mark.parametrize("style", STYLES)
def test_mask_is_exactly_assistant_content_and_its_end_of_turn_token(folders, style):
    ours = load_tokenizer(folders[style])
    chat = SYSTEM_CHAT  # gemma folds the system turn into the first user turn: still not trained
    ids, mask = ours.tokenize_messages(chat)
    assert ids == ours.apply_chat_template(chat)
    # llama3 and gemma templates trim content; chatml keeps it verbatim
    contents = [m["content"] if style == "chatml" else m["content"].strip() for m in chat if m["role"] == "assistant"]
    assert trained_pieces(ours, ids, mask) == [content + END_OF_TURN[style] for content in contents]


def test_mask_follows_generation_blocks_like_transformers(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
              "{% endfor %}")
    edit_config(folder, chat_template=source)
    ours, theirs = both(folder)
    expected = theirs.apply_chat_template(SYSTEM_CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = ours.tokenize_messages(SYSTEM_CHAT)
    assert ids == expected["input_ids"] and [int(m) for m in mask] == expected["assistant_masks"]


def test_mask_when_earlier_turns_render_differently(folders, tmp_path):
    """Like Qwen3: the last assistant turn gets an empty think block that earlier turns do not."""
    folder = copy_of(folders["chatml"], tmp_path)
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}"
              "<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    edit_config(folder, chat_template=source)
    ours = load_tokenizer(folder)
    chat = PLAIN_CHAT[:2] + [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "OK"}]
    ids, mask = ours.tokenize_messages(chat)
    assert trained_pieces(ours, ids, mask) == ["Hello! How can I help?<|im_end|>",
                                               "<think>\n\n</think>\n\nOK<|im_end|>"]


def test_mask_when_earlier_turns_drop_inline_reasoning(folders, tmp_path):
    """Qwen3's template splits content on </think> and keeps earlier turns' answers only: such a turn, written
    with its reasoning inline (as many reasoning datasets are), trained on nothing."""
    ours, theirs = chatml_with(folders, tmp_path, (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% set c = m.content %}"
        "{% if m.role == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1].lstrip('\\n') %}"
        "{% endif %}{{ c }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}"))
    chat = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHi!"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    ids, mask = ours.tokenize_messages(chat)
    assert ids == theirs.apply_chat_template(chat, return_dict=False)
    assert trained_pieces(ours, ids, mask) == ["Hi!<|im_end|>", "<think>\nadd\n</think>\n\n4<|im_end|>"]


def test_mask_covers_tool_calls_of_an_assistant_turn_without_content(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.content %}\n{{ m.content }}{% endif %}"
        "{% for call in m.tool_calls | default([]) %}\n<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ours, theirs = both(folder)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    chat = [{"role": "user", "content": "add"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "1"}, {"role": "assistant", "content": "It is 1."}]
    ids, mask = ours.tokenize_messages(chat)
    assert ids == theirs.apply_chat_template(chat, return_dict=False)
    assert trained_pieces(ours, ids, mask) == [
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>', "It is 1.<|im_end|>"]


#: Qwen3's way with agent turns, cut down: reasoning shown only after the last user query (and an empty think block
#: on the last turn), tool calls after the content, tool results as user turns. GEN marks each assistant turn's
#: text and end token with {% generation %}, for transformers' assistant mask.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}GEN_START"
    "{%- set reasoning = m.reasoning_content | default('', true) -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- if m.content %}{{ m.content }}{% endif -%}"
    "{%- for call in m.tool_calls | default([], true) -%}"
    "{{ '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>' }}GEN_END{{ '\\n' }}"
    "{%- elif m.role == 'tool' -%}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}")


def _call(city: str) -> dict:
    return {"type": "function", "function": {"name": "weather", "arguments": {"city": city}}}


@pytest.mark.parametrize("chat", [
    [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": None, "tool_calls": [_call("Paris")]},
     {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}],
    [{"role": "user", "content": "Paris?"},
     {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("Paris"), _call("Lyon")]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"},
     {"role": "assistant", "content": "Sun, then rain."}],
    [{"role": "user", "content": "Paris?"},
     {"role": "assistant", "content": None, "reasoning_content": "use tool", "tool_calls": [_call("Paris")]},
     {"role": "tool", "content": "sunny"}, {"role": "assistant", "reasoning_content": "reply", "content": "Sunny."},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Bye."}],
], ids=["call-without-content", "content-and-parallel-calls", "reasoning-dropped-before-the-last-query"])
def test_agent_turns_of_a_template_that_rewrites_earlier_turns_are_masked_as_its_generation_blocks(
        folders, tmp_path, chat):
    """Qwen3-style templates render an assistant turn otherwise once more turns follow. Middle turns' tool calls
    trained one character of their call (the rest and the end token untrained), and a turn after a dropped
    reasoning trace took in the tool's result and the next header. The plain template now masks what transformers
    masks on the same template with {% generation %} blocks."""
    plain = copy_of(folders["chatml"], tmp_path)
    edit_config(plain, chat_template=QWEN3_LIKE.replace("GEN_START", "").replace("GEN_END", ""))
    marked = Path(shutil.copytree(folders["chatml"], tmp_path / "marked"))
    edit_config(marked, chat_template=QWEN3_LIKE.replace("GEN_START", "{% generation %}")
                .replace("GEN_END", "{% endgeneration %}"))
    ours = load_tokenizer(plain)
    expected = AutoTokenizer.from_pretrained(marked).apply_chat_template(
        chat, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = ours.tokenize_messages(chat)
    assert ids == expected["input_ids"]
    assert [int(m) for m in mask] == expected["assistant_masks"], trained_pieces(ours, ids, mask)


def test_assistant_text_repeated_from_the_prompt_is_masked_only_in_the_answer(folders):
    ours = load_tokenizer(folders["chatml"])
    chat = [{"role": "user", "content": "assistant OK"}, {"role": "assistant", "content": "OK"}]
    ids, mask = ours.tokenize_messages(chat)
    assert trained_pieces(ours, ids, mask) == ["OK<|im_end|>"]


def test_train_on_input_and_max_seq_len(folders):
    ours = load_tokenizer(folders["llama3"])
    ids, mask = ours.tokenize_messages(SYSTEM_CHAT, train_on_input=True)
    assert all(mask) and len(mask) == len(ids)
    short, short_mask = ours.tokenize_messages(SYSTEM_CHAT, max_seq_len=7)
    assert short == ids[:7] and len(short_mask) == 7


# -- save -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", (*STYLES, None))
def test_saved_files_load_in_transformers_with_the_same_ids(folders, tmp_path, style):
    ours = load_tokenizer(folders[style])
    out = ours.save(tmp_path / "saved")
    theirs, again = AutoTokenizer.from_pretrained(out), load_tokenizer(out)
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text) == again.encode(text)
    if style is not None:
        assert (out / "chat_template.jinja").is_file()
        assert theirs.apply_chat_template(SYSTEM_CHAT, return_dict=False) == ours.apply_chat_template(SYSTEM_CHAT)


def test_named_templates_save_as_transformers_5_does(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, chat_template=[{"name": "default", "template": "d"}, {"name": "tool_use", "template": "t"}])
    out = load_tokenizer(folder).save(tmp_path / "saved")
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "t"
    assert AutoTokenizer.from_pretrained(out).chat_template == {"default": "d", "tool_use": "t"}
    assert load_tokenizer(out).chat_template == {"default": "d", "tool_use": "t"}


# -- errors ---------------------------------------------------------------------------------------

def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(PosttuneError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_folder_without_tokenizer_json(tmp_path):
    assert "has no tokenizer.json" in one_line_error(load_tokenizer, tmp_path)


def test_missing_folder_that_is_no_hub_id(tmp_path):
    assert "no such folder" in one_line_error(load_tokenizer, str(tmp_path / "nope"))


def test_invalid_tokenizer_config(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    assert "tokenizer_config.json: invalid JSON" in one_line_error(load_tokenizer, folder)
    edit_config_text = json.dumps({"chat_template": 3})
    (folder / "tokenizer_config.json").write_text(edit_config_text)
    assert "'chat_template' must be a string" in one_line_error(load_tokenizer, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    assert "'eos_token' must be a token string, got 7" in one_line_error(load_tokenizer, folder)


def test_template_that_raises(folders):
    ours = load_tokenizer(folders["start_of_turn"])
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    message = one_line_error(ours.apply_chat_template, chat)
    assert "rejected the messages: Conversation roles must alternate" in message


def test_template_syntax_error(folders, tmp_path):
    folder = copy_of(folders["chatml"], tmp_path)
    edit_config(folder, chat_template="{% for m in messages %}")
    assert "line 1" in one_line_error(load_tokenizer(folder).apply_chat_template, PLAIN_CHAT)


def test_missing_chat_template_says_which_file_to_add(folders):
    ours = load_tokenizer(folders[None])
    assert "add chat_template.jinja" in one_line_error(ours.apply_chat_template, PLAIN_CHAT)


def test_unknown_role(folders):
    ours = load_tokenizer(folders["chatml"])
    message = one_line_error(ours.tokenize_messages, [{"role": "bot", "content": "hi"}])
    assert message.startswith("chat message 0: unknown role 'bot'")


@pytest.mark.parametrize("size, problem", [(100, "a tiny tokenizer holds its 256 bytes"),
                                           (1000, "this tiny tokenizer comes out with")])
def test_a_tiny_tokenizer_of_a_size_it_cannot_have_is_refused(tmp_path, size, problem):
    """A model sized to the asked vocabulary would silently not match the tokenizer written."""
    with pytest.raises(ValueError, match=f"vocab_size {size}: {problem}"):
        save_tiny_tokenizer(tmp_path / "tok", vocab_size=size)
    assert load_tokenizer(save_tiny_tokenizer(tmp_path / "ok", vocab_size=512)).vocab_size == 512


@pytest.mark.parametrize("style", STYLES)
def test_each_tiny_tokenizer_is_the_same_in_every_process(style):
    """The Gemma-style one trained its alphabet with ties broken differently per process: a fixture saved in one
    and read again in another tokenized the same text to other ids."""
    program = ("import hashlib, sys; from posttune.tiny_tokenizer import build_tiny_tokenizer; "
               "print(hashlib.sha256(build_tiny_tokenizer(sys.argv[1]).to_str().encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", program, style], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in (1, 2, 3)}
    assert len(digests) == 1
