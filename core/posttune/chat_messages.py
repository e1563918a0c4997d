"""Chat messages and tool definitions from dataset rows, checked, in the shape chat templates expect.

A turn keeps its role and text and what tool use and reasoning add to it (and axolotl's ``weight``: 0 leaves an
assistant turn untrained): an assistant turn's
``tool_calls`` (its text may then be absent or null), a tool result's ``tool_call_id`` and ``name``,
and a reasoning trace (``reasoning_content``, ``thinking``, ``reasoning``). A row's ``tools`` (the
functions the model may call, as JSON schemas) go to the template beside its messages, as
transformers' ``apply_chat_template(messages, tools=...)`` and TRL's ``tools`` column do.

Two normalisations, both for data read through `datasets` (Arrow): nulls inside tool calls and tool
schemas are dropped, because Arrow gives every object of a column the union of all their keys
(``{"city": "Paris", "unit": None}`` where the row held ``{"city": "Paris"}``); and a tool call's
``arguments`` or a row's ``tools`` stored as a JSON string (how OpenAI's API writes them, and how
datasets keep objects of varying shapes) are parsed, since templates write them with ``tojson``
and vLLM's chat server parses them the same way before rendering. No torch here: ``posttune
validate`` checks a dataset's first row with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: fields a turn keeps beside its role and text: a tool result's, and the reasoning trace's spellings
KEPT_FIELDS = ("tool_call_id", "name", "reasoning_content", "thinking", "reasoning")
TOOLS = "tools"  # the row field holding the tool definitions


def chat_message(turn: Any, where: str, roles: Mapping[str, str] | None = None, *,
                 role_key: str = "role", content_key: str = "content") -> dict[str, Any]:
    """One turn as ``{"role", "content", ...}``; a bad one raises ValueError naming ``where`` and the field.

    ``roles`` maps the dataset's role names to the template's (None: any string role, checked when the
    chat is rendered). Text is required unless an assistant turn calls tools."""
    if not isinstance(turn, Mapping):
        raise ValueError(f"field '{where}' must be an object with '{role_key}' and '{content_key}'")
    role, content = turn.get(role_key), turn.get(content_key)
    if role_key not in turn:
        fields = [key if isinstance(key, str) and key.isprintable() and key.strip() == key else repr(key)
                  for key in list(turn)[:8]]  # one line, whatever the keys hold
        more = ", ..." if len(turn) > 8 else ""
        raise ValueError(f"field '{where}' has no '{role_key}' (its fields: {', '.join(fields)}{more}){_shape(turn)}")
    if not isinstance(role, str) or (roles is not None and role not in roles):
        expected = f" (expected one of {', '.join(sorted(roles))})" if roles is not None else ""
        raise ValueError(f"field '{where}.{role_key}': unknown role {role!r}{expected}")
    role = roles[role] if roles is not None else role
    message: dict[str, Any] = {"role": role}
    calls = turn.get("tool_calls")
    if isinstance(calls, list) and not calls:  # exports write [] for a turn without calls, as for a row's tools
        calls = None
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"field '{where}.tool_calls': only an assistant turn calls tools, this one is {role!r}")
        message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{index}]")
                                 for index, call in enumerate(_non_empty_list(calls, f"{where}.tool_calls"))]
    if isinstance(content, list):  # OpenAI's content parts: [{"type": "text", "text": ...}, ...]
        content = _text_of_parts(content, f"{where}.{content_key}")
    if isinstance(content, str):
        message["content"] = content
    elif content is not None or calls is None:
        raise ValueError(f"field '{where}.{content_key}' must be a string (or a list of text parts)")
    weight = turn.get("weight")
    if weight is not None:  # axolotl's per-turn switch: 0 leaves an assistant turn untrained
        if isinstance(weight, bool) or weight not in (0, 1):
            raise ValueError(f"field '{where}.weight' must be 0 (not trained) or 1, got {weight!r}")
        if weight == 0:  # 1, the default, is left out: the template sees the turn as it was
            message["weight"] = 0
    for key in KEPT_FIELDS:
        text = turn.get(key)
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(f"field '{where}.{key}' must be a string")
        message[key] = text
    return message


def _text_of_parts(parts: list[Any], where: str) -> str:
    """OpenAI's content parts as one text: the text parts in order, joined by newlines as vLLM's OpenAI server joins
    them (joined end to end, "What is" and "this?" ran together). Another kind (an image, a file) is refused: the
    models here read text."""
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = repr(kind) if kind is not None else type(part).__name__
            raise ValueError(f"field '{where}[{index}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                             f"read, got {shown}")
        texts.append(part["text"])
    return "\n".join(texts)


def row_tools(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The row's ``tools``: a list of tool definitions (objects), or a JSON string of one; None without any."""
    tools = row.get(TOOLS)
    if isinstance(tools, str):
        tools = _parsed(tools, TOOLS, "a list of tool definitions")
    if tools is None or (isinstance(tools, list) and not tools):
        return None
    tools = _non_empty_list(tools, TOOLS)
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"field 'tools[{index}]' must be a tool definition (an object), got {type(tool).__name__}")
    return [without_nulls(tool) for tool in tools]


def without_nulls(data: Any) -> Any:
    """``data`` with every null entry of its objects dropped, at any depth (list items are kept)."""
    if isinstance(data, Mapping):
        return {key: without_nulls(item) for key, item in data.items() if item is not None}
    if isinstance(data, list):
        return [without_nulls(item) for item in data]
    return data


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A call as ``{"type": "function", "function": {"name", "arguments"}}`` (or the flat ``{"name",
    "arguments"}`` some datasets use), nulls dropped and JSON-string arguments parsed."""
    if not isinstance(call, Mapping):
        raise ValueError(f"field '{where}' must be an object")
    call = without_nulls(call)
    function = call.get("function", call)
    inner = f"{where}.function" if "function" in call else where
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"field '{inner}.name' must be a string (the function called)")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = _parsed(arguments, f"{inner}.arguments", "an object")
        function = {**function, "arguments": arguments}
    if arguments is not None and not isinstance(arguments, Mapping):
        raise ValueError(f"field '{inner}.arguments' must be an object or a JSON string of one")
    return {**call, "function": function} if "function" in call else function


def _parsed(text: str, where: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError(f"field '{where}' is a string but not JSON (expected {what})") from None


def _non_empty_list(items: Any, where: str) -> Sequence[Any]:
    if not isinstance(items, list) or not items:
        raise ValueError(f"field '{where}' must be a non-empty list")
    return items


def _shape(turn: Mapping[str, Any]) -> str:
    """Where a turn of the other chat shape is read (a column mapped to the wrong one: axolotl's field_messages)."""
    if "from" in turn and "value" in turn:
        return ("; ShareGPT turns (from/value) are read from a row's 'conversations': "
                "column_map: {conversations: COLUMN}")
    if "role" in turn and "content" in turn:
        return "; OpenAI turns (role/content) are read from a row's 'messages': column_map: {messages: COLUMN}"
    return "; a turn is role/content (OpenAI 'messages') or from/value (ShareGPT 'conversations'), renamed by no option"
