"""Preference pairs -> two training samples sharing a prompt: (chosen, rejected).

A ``preference`` format's transform returns a :class:`PreferencePair` of chat messages. Each
response is rendered after the prompt with the checkpoint's own chat template; the prompt's
tokens are masked, so only the final response is scored (also when the prompt holds earlier
assistant turns). Truncation keeps the prompt's *tail* (``max_prompt_len``: the turn closest to
the response matters most) and cuts the responses on the right to ``max_seq_len``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttune.chat_messages import chat_message
from posttune.data.samples import SampleMaker, shift_labels

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class PreferencePair:
    """One row of preference data: a prompt and two responses to it, as chat messages."""

    prompt: Messages
    chosen: Messages
    rejected: Messages


class PairMaker(SampleMaker):
    """Turns preference rows into ``[(chosen ids, labels), (rejected ids, labels)]`` (a sample group).

    Row errors, ``skip_bad_rows`` and the skip counts are ``SampleMaker``'s.
    """

    kind = "preference"

    def __init__(self, fmt: Any, tokenizer: Any, *, max_seq_len: int, max_prompt_len: int | None = None,
                 **kwargs: Any):
        super().__init__(fmt, tokenizer, max_seq_len=max_seq_len, **kwargs)
        self.max_prompt_len = max_prompt_len

    def make(self, pair: PreferencePair) -> list[tuple[list[int], list[int]]] | None:
        return self.responses(pair.prompt, (pair.chosen, pair.rejected))

    def responses(self, prompt_messages: Messages,
                  responses: Sequence[Messages]) -> list[tuple[list[int], list[int]]] | None:
        """``(ids, labels)`` of each response rendered after the prompt, the prompt masked (its tail kept under
        ``max_prompt_len``), cut to ``max_seq_len``; None when truncation leaves one with nothing to score.
        A preference pair has two responses; a method that scores a single response passes one."""
        messages = self.with_system(prompt_messages)
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=self.tools)
        cut = max(0, len(prompt) - self.max_prompt_len) if self.max_prompt_len is not None else 0
        samples = []
        for response in responses:
            ids, trained = self.tokenizer.tokenize_messages([*messages, *response], tools=self.tools)
            if list(ids[: len(prompt)]) != list(prompt):
                raise ValueError("the chat template renders the prompt differently once a response follows it, "
                                 "so the prompt cannot be masked")
            trained = [False] * len(prompt) + list(trained[len(prompt):])
            self.cut = self.cut or len(ids) - cut > self.max_seq_len  # a response's end past max_seq_len
            ids, trained = list(ids[cut:])[: self.max_seq_len], trained[cut:][: self.max_seq_len]
            if not any(trained[1:]):  # truncation left nothing of this response to score
                return None
            samples.append((ids, shift_labels(ids, trained)))
        return samples


def as_messages(value: Any, field: str, role: str) -> Messages:
    """A string (one ``role`` turn) or a list of ``{"role", "content"}`` messages (tool calls and reasoning
    kept, `posttune.chat_messages`), checked."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(f"field '{field}' must be a string or a non-empty list of messages")
    return [chat_message(message, f"{field}[{index}]") for index, message in enumerate(value)]


def preference_pair(row: Mapping[str, Any]) -> PreferencePair:
    """A row with an explicit ``prompt``, or ``chosen``/``rejected`` conversations sharing their start.

    Explicit: ``prompt`` (string or messages), ``chosen`` and ``rejected`` (strings: one assistant
    turn, or messages). Implicit: both are whole conversations; the prompt is the messages they
    share from the start, and each response is the rest.
    """
    if row.get("chosen") is None:
        raise KeyError("chosen")
    if row.get("rejected") is None:
        raise KeyError("rejected")
    chosen = as_messages(row["chosen"], "chosen", "assistant")
    rejected = as_messages(row["rejected"], "rejected", "assistant")
    if row.get("prompt") is not None:
        return PreferencePair(as_messages(row["prompt"], "prompt", "user"), chosen, rejected)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ValueError("no 'prompt' field, and 'chosen' and 'rejected' share no first message to use as the "
                         "prompt")
    if shared == len(chosen) or shared == len(rejected):
        raise ValueError("'chosen' and 'rejected' are the same conversation up to the end of one of them: "
                         "nothing is left to compare")
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:])
