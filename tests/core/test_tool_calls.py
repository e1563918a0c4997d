"""Tool-calling data: a row's tool calls, tool results and ``tools`` reach the chat template, as transformers renders
them, through every kind of row (conversations, preference pairs, prompts), read through `datasets` (Arrow)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import posttune_generate
import posttune_lora
import pytest
from transformers import AutoTokenizer

from posttune.chat_messages import chat_message, row_tools
from posttune.data import PairMaker, PromptMaker, SampleMaker
from posttune.errors import PosttuneError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("datasets_cache")

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def chats() -> list[tuple[list[dict], list[dict]]]:
    """(messages, tools) as a user writes them: calls of different shapes, a turn with text and a call."""
    return [
        ([{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "tool_calls": [call("weather", city="Paris")]},
          {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
          {"role": "assistant", "content": "Sunny in Paris."}], [WEATHER, ADD]),
        ([{"role": "user", "content": "What is 2 + 3?"},
          {"role": "assistant", "content": "Adding.", "tool_calls": [call("add", a=2, b=3), call("add", a=0, b=1)]},
          {"role": "tool", "content": "5"}, {"role": "tool", "content": "1"},
          {"role": "assistant", "content": "It is 5."}], [ADD]),
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), template="chatml")


@pytest.fixture(scope="module")
def chat_format():
    return new_plugin_set().registry.get("dataset_format", "chat")


def arrow_rows(tmp_path: Path, rows: list[dict]) -> list[dict]:
    """The rows as `datasets` gives them back from a Parquet file (the hub's format): objects as Arrow structs."""
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return list(datasets.load_dataset("parquet", data_files=str(path), split="train"))


def trained_text(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of trained tokens (labels are pre-shifted: label t is the target of position t)."""
    runs, current = [], []
    for position in range(1, len(ids)):
        if labels[position - 1] != -100:
            current.append(ids[position])
        elif current:
            runs.append(tokenizer.decode(current)), current.clear()
    return runs + ([tokenizer.decode(current)] if current else [])


def test_sft_samples_of_tool_calling_chats_are_what_transformers_renders(folder, chat_format, tmp_path):
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    rows = [{"messages": messages, "tools": tools} for messages, tools in chats()]
    read = arrow_rows(tmp_path, rows)
    # Arrow gives every call's arguments every key any call has: {"city": "Paris", "a": None, "b": None}
    assert read[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "a": None, "b": None}
    make = SampleMaker(chat_format, ours, max_seq_len=512)
    for index, ((messages, tools), row) in enumerate(zip(chats(), read, strict=True)):
        ids, labels = make(row, index)
        assert ids == theirs.apply_chat_template(messages, tools=tools, return_dict=False)
        assert "<tools>" in ours.decode(ids)
    ids, labels = make(read[0], 0)
    assert trained_text(ours, ids, labels) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "Sunny in Paris.<|im_end|>"]  # the call and the answer; not the tool's result or the tool list
    ids, labels = make(read[1], 1)
    assert trained_text(ours, ids, labels)[0] == (
        'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 1}}\n</tool_call><|im_end|>')


def test_json_string_arguments_and_tools_read_as_the_objects_they_hold(folder, chat_format, tmp_path):
    """How OpenAI's API and Arrow-friendly datasets store them: parsed, as vLLM's chat server parses them."""
    messages, tools = chats()[0]
    as_strings = [dict(m) for m in messages]
    as_strings[1] = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})}}]}
    row = arrow_rows(tmp_path, [{"messages": as_strings, "tools": json.dumps(tools)}])[0]
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    ids, _ = SampleMaker(chat_format, ours, max_seq_len=512)(row, 0)
    assert ids == theirs.apply_chat_template(messages, tools=tools, return_dict=False)


def test_sharegpt_turns_keep_their_calls(folder, chat_format):
    messages, tools = chats()[0]
    roles = {"user": "human", "assistant": "gpt", "tool": "observation"}
    turns = [{"from": roles[m["role"]], "value": m.get("content"), "tool_calls": m.get("tool_calls")}
             for m in messages]
    theirs = AutoTokenizer.from_pretrained(folder)
    ids, _ = SampleMaker(chat_format, load_tokenizer(folder),
                         max_seq_len=512)({"conversations": turns, "tools": tools}, 0)
    plain = [{key: m[key] for key in ("role", "content", "tool_calls") if key in m} for m in messages]
    assert ids == theirs.apply_chat_template(plain, tools=tools, return_dict=False)


def test_preference_pairs_and_prompts_render_with_their_tools(folder):
    registry = new_plugin_set().registry
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    messages, tools = chats()[0]
    prompt, chosen = messages[:1], messages[1:2]
    rejected = [{"role": "assistant", "content": "I do not know."}]
    pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": tools}
    made = PairMaker(registry.get("dataset_format", "preference"), ours, max_seq_len=512)(pair, 0)
    for (ids, _), response in zip(made, (chosen, rejected), strict=True):
        assert ids == theirs.apply_chat_template(prompt + response, tools=tools, return_dict=False)
    ids, row = PromptMaker(registry.get("dataset_format", "prompt"), ours)({"prompt": prompt, "tools": tools}, 0)
    assert ids == theirs.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, return_dict=False)
    assert row.fields["tools"] == tools  # the rewards see them too


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}], "tools": "not json"},
     "field 'tools' is a string but not JSON (expected a list of tool definitions)"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [1]},
     "field 'tools[0]' must be a tool definition (an object), got int"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [call("add")]}]},
     "field 'messages[0].tool_calls': only an assistant turn calls tools, this one is 'user'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}]},
     "field 'messages[1].content' must be a string (or a list of text parts)"),  # no calls ([] from an export), no text
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": call("add")}]},
     "field 'messages[1].tool_calls' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "field 'messages[1].tool_calls[0].function.name' must be a string (the function called)"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"name": "add", "arguments": "[1, 2]"}]}]},
     "field 'messages[1].tool_calls[0].arguments' must be an object or a JSON string of one"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
     "field 'messages[1].content' must be a string (or a list of text parts)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "field 'messages[0].content[0]': only text parts ({\"type\": \"text\", \"text\": ...}) are read, got "
     "'image_url'"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 7}]},
     "field 'messages[0].tool_call_id' must be a string"),
]


@pytest.mark.parametrize(("row", "problem"), BAD)
def test_a_bad_tool_field_names_the_row_and_the_field(folder, chat_format, row, problem):
    make = SampleMaker(chat_format, load_tokenizer(folder), max_seq_len=512)
    with pytest.raises(PosttuneError) as caught:
        make(row, 3)
    assert str(caught.value) == f"data.train: row 3: {problem} (set data.skip_bad_rows: true to skip such rows)"


def test_openai_content_parts_read_as_their_joined_text(tmp_path, folder, chat_format):
    """OpenAI's messages may hold a list of parts; text parts joined by newlines are what vLLM's server reads (also
    through Arrow, which gives every part the union of the parts' keys)."""
    make = SampleMaker(chat_format, load_tokenizer(folder), max_seq_len=512)
    plain = {"messages": [{"role": "user", "content": "Reverse:\nABC"}, {"role": "assistant", "content": "CBA"}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Reverse:"},
                                                       {"type": "text", "text": "ABC"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "CBA"}]}]}
    want = make(plain, 0)
    for row in (parts, *arrow_rows(tmp_path, [parts])):
        assert repr(make(row, 0)) == repr(want)


def test_a_template_that_ignores_tools_is_refused_rather_than_dropping_them(tmp_path, chat_format):
    """The tiny gemma-style template renders neither tools nor tool calls: the text would silently lack them."""
    make = SampleMaker(chat_format, load_tokenizer(save_tiny_tokenizer(tmp_path / "tok", template="start_of_turn")),
                       max_seq_len=512)
    with pytest.raises(PosttuneError, match="never reads `tools`, so the tool definitions would be left out"):
        make({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
              "tools": [ADD]}, 0)
    with pytest.raises(PosttuneError, match="never reads `tool_calls`, so the tool calls would be left out"):
        make({"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "tool_calls": [call("add", a=1)]}]}, 0)
    # an empty list of calls (Arrow's value for a turn without any) holds nothing to leave out
    ids, labels = make({"messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "ok", "tool_calls": []}]}, 0)
    assert any(label != -100 for label in labels)


def test_rows_without_tools_are_unchanged():
    assert (row_tools({"messages": []}) is None and row_tools({"tools": []}) is None
            and row_tools({"tools": "[]"}) is None)
    turn = {"role": "assistant", "content": "ok", "tool_calls": None, "weight": 1, "reasoning_content": "think"}
    assert chat_message(turn, "messages[0]") == {"role": "assistant", "content": "ok", "reasoning_content": "think"}


@pytest.fixture
def llama_sft(register_plugin):
    import posttune_llama
    import posttune_sft

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def test_validate_refuses_a_bad_tools_field_and_a_run_trains_on_tool_calls(llama_sft, posttune_cli, folder, tmp_path):
    from run_support import metrics, tiny_run_config, write

    rows = [{"messages": messages, "tools": tools} for messages, tools in chats()] * 4
    config = tiny_run_config(tmp_path, [{**rows[0], "tools": "{"}, *rows], fmt="chat", base_method={"name": "sft"},
                             batch_size=2, tokenizer={"path": str(folder)}, data={"max_seq_len": 512})
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2, result.stderr
    assert (f"config: data.train: the first row of {tmp_path / 'train.jsonl'}: field 'tools' is a string but not "
            "JSON (expected a list of tool definitions)") in result.stderr
    config = tiny_run_config(tmp_path, rows, fmt="chat", base_method={"name": "sft"}, batch_size=2,
                             tokenizer={"path": str(folder)}, data={"max_seq_len": 512})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    losses = [record["loss"] for record in metrics(tmp_path / "out") if "loss" in record]
    assert len(losses) == 4 and all(loss == loss for loss in losses)  # 8 chats, 2 per step; finite


def test_a_turn_with_weight_0_is_not_trained(folder, chat_format):
    """axolotl's per-turn ``weight``: 0 leaves that assistant turn's tokens (and its end-of-turn token) untrained,
    the others as before; in OpenAI and ShareGPT rows alike. Other values are refused."""
    make = SampleMaker(chat_format, load_tokenizer(folder), max_seq_len=512)

    def trained(row):
        return [label for label in make(row, 0)[1] if label != -100]

    turns = [{"role": "user", "content": "Reverse: AB"}, {"role": "assistant", "content": "BA"},
             {"role": "user", "content": "Reverse: XYZ"}, {"role": "assistant", "content": "ZYX"}]
    everything, first = trained({"messages": turns}), trained({"messages": turns[:2]})
    assert everything[:len(first)] == first and len(everything) > len(first)
    muted = [turns[0], {**turns[1], "weight": 0}, turns[2], {**turns[3], "weight": 1}]
    assert trained({"messages": muted}) == everything[len(first):]
    shared = [{"from": "human", "value": "Reverse: AB"}, {"from": "gpt", "value": "BA", "weight": 0},
              {"from": "human", "value": "Reverse: XYZ"}, {"from": "gpt", "value": "ZYX"}]
    assert trained({"conversations": shared}) == everything[len(first):]
    with pytest.raises(PosttuneError, match=r"field 'messages\[1\]\.weight' must be 0 \(not trained\) or 1, got 0\.5"):
        make({"messages": [turns[0], {**turns[1], "weight": 0.5}]}, 0)


def test_train_on_input_keeps_a_turn_with_weight_0_untrained(folder, chat_format):
    """``train_on_input`` trains the prompt too, not a turn the row switched off: every token but the muted turn's
    (its content and end-of-turn token) is trained, as axolotl's ``train_on_inputs`` with turn weights."""
    tokenizer = load_tokenizer(folder)
    turns = [{"role": "user", "content": "Reverse: AB"}, {"role": "assistant", "content": "BA"},
             {"role": "user", "content": "Reverse: XYZ"}, {"role": "assistant", "content": "ZYX"}]
    ids, everything = tokenizer.tokenize_messages(turns, train_on_input=True)
    assert all(everything)
    muted = [turns[0], {**turns[1], "weight": 0}, *turns[2:]]
    same_ids, mask = tokenizer.tokenize_messages(muted, train_on_input=True)
    _, assistant_mask = tokenizer.tokenize_messages(turns)
    _, muted_mask = tokenizer.tokenize_messages(muted)
    off = [i for i, (a, m) in enumerate(zip(assistant_mask, muted_mask, strict=True)) if a and not m]
    assert same_ids == ids and off  # the muted turn's tokens: trained by the assistant mask, not by the muted one
    assert [i for i, trained in enumerate(mask) if not trained] == off


@pytest.mark.parametrize(("row", "hint"), [
    ({"messages": [{"from": "human", "value": "Reverse: AB"}]},
     "ShareGPT turns (from/value) are read from a row's 'conversations': column_map: {conversations: COLUMN}"),
    ({"conversations": [{"role": "user", "content": "Reverse: AB"}]},
     "OpenAI turns (role/content) are read from a row's 'messages': column_map: {messages: COLUMN}"),
    ({"messages": [{"speaker": "user", "text": "Reverse: AB"}]},
     "a turn is role/content (OpenAI 'messages') or from/value (ShareGPT 'conversations'), renamed by no option"),
])
def test_a_turn_of_the_other_shape_names_where_it_is_read(folder, chat_format, row, hint):
    """axolotl's ``field_messages: chats`` ported as ``column_map: {messages: chats}`` on ShareGPT rows said
    "unknown role None"; the turn's fields and where that shape is read are named instead."""
    make = SampleMaker(chat_format, load_tokenizer(folder), max_seq_len=512)
    with pytest.raises(PosttuneError) as caught:
        make(row, 0)
    assert "(its fields: " in str(caught.value) and f"; {hint} (set data.skip_bad_rows" in str(caught.value)
