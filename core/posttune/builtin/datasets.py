"""Built-in dataset formats: alpaca, chat (OpenAI ``messages`` or ShareGPT ``conversations``), text,
completion (TRL's prompt-completion rows) (kind ``conversation``), preference and preference_text (kind
``preference``) and prompt (kind ``prompt``).

A ``conversation`` transform returns chat messages (``[{"role", "content"}]``) to be rendered with the
checkpoint's chat template, a plain string for completion-style training on every token, or a
``PromptCompletion`` (a prompt and the completion that trains, text or messages). A
``preference`` transform returns a ``PreferencePair`` (prompt, chosen and rejected: messages, or text); a
``prompt`` transform a ``PromptRow`` (the prompt and the row's other fields, for online methods).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.chat_messages import chat_message
from posttune.descriptors import DatasetFormat
from posttune.plugins import PLUGIN_API, hookimpl

POSTTUNE_PLUGIN_API = PLUGIN_API

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}


def field_of(row: Mapping[str, Any], name: str, *, optional: bool = False) -> Any:
    """``row[name]`` as a string; a missing or non-string field raises naming it."""
    value = row.get(name)
    if value is None:
        if optional:
            return ""
        raise KeyError(name)
    if not isinstance(value, str):
        raise ValueError(f"field '{name}' must be a string, got {type(value).__name__}")
    return value


def alpaca(row: Mapping[str, Any]) -> list[dict[str, str]]:
    instruction = field_of(row, "instruction")
    extra = field_of(row, "input", optional=True)
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": field_of(row, "output")}]


def chat(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The turns, with their tool calls, tool results' ids and reasoning (`posttune.chat_messages`)."""
    if row.get("messages") is not None:
        return [chat_message(m, f"messages[{i}]", {r: r for r in ROLES})
                for i, m in enumerate(_turns(row, "messages"))]
    if row.get("conversations") is not None:
        return [chat_message(m, f"conversations[{i}]", SHAREGPT_ROLES, role_key="from", content_key="value")
                for i, m in enumerate(_turns(row, "conversations"))]
    raise KeyError("messages")


def _turns(row: Mapping[str, Any], name: str) -> list[Any]:
    turns = row[name]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"field '{name}' must be a non-empty list of turns")
    return turns


def text(row: Mapping[str, Any]) -> str:
    return field_of(row, "text")


def completion(row: Mapping[str, Any]) -> Any:
    """TRL's prompt-completion rows: ``prompt`` and ``completion``, both text or both lists of messages."""
    from posttune.data.preference import as_messages
    from posttune.data.samples import PromptCompletion

    prompt, answer = row.get("prompt"), row.get("completion")
    for name, value in (("prompt", prompt), ("completion", answer)):
        if value is None:
            raise KeyError(name)
    if isinstance(prompt, str) != isinstance(answer, str):
        raise ValueError("fields 'prompt' and 'completion' must both be text or both be lists of messages")
    if isinstance(prompt, str):
        return PromptCompletion(prompt, answer)
    return PromptCompletion(as_messages(prompt, "prompt", "user"), as_messages(answer, "completion", "assistant"))


def preference(row: Mapping[str, Any]) -> Any:
    from posttune.data.preference import preference_pair

    return preference_pair(row)


def preference_text(row: Mapping[str, Any]) -> Any:
    from posttune.data.preference import text_pair

    return text_pair(row)


def prompt(row: Mapping[str, Any]) -> Any:
    from posttune.data.prompts import prompt_row

    return prompt_row(row)


@hookimpl
def posttune_register_datasets(register):
    register(DatasetFormat("alpaca", "conversation", alpaca, ("instruction", "input", "output"),
                           "instruction/input/output rows as one user and one assistant turn"))
    register(DatasetFormat("chat", "conversation", chat, ("messages",),
                           "OpenAI `messages` (role/content) or ShareGPT `conversations` (from/value)"))
    register(DatasetFormat("text", "conversation", text, ("text",),
                           "plain text, trained on every token (no chat template)"))
    register(DatasetFormat("completion", "conversation", completion, ("prompt", "completion"),
                           "TRL's prompt-completion rows, trained on the completion: both text (no chat template) "
                           "or both messages"))
    register(DatasetFormat("preference", "preference", preference, ("prompt", "chosen", "rejected"),
                           "prompt + chosen/rejected (strings or messages), or chosen/rejected conversations "
                           "sharing a prompt"))
    register(DatasetFormat("preference_text", "preference", preference_text, ("prompt", "chosen", "rejected"),
                           "TRL's standard preference rows: prompt + chosen/rejected as plain text (no chat "
                           "template), or chosen/rejected texts sharing their opening text"))
    register(DatasetFormat("prompt", "prompt", prompt, ("prompt",),
                           "a prompt (string or messages) to generate from; every other field (e.g. answer) is "
                           "kept for the reward functions"))
