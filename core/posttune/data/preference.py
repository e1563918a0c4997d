"""Preference pairs -> two training samples sharing a prompt: (chosen, rejected).

A ``preference`` format's transform returns a :class:`PreferencePair` of chat messages. Each
response is rendered after the prompt with the checkpoint's own chat template; the prompt's
tokens are masked, so only the final response is scored (also when the prompt holds earlier
assistant turns). A ``preference_text`` pair holds plain text instead (TRL's "standard" rows):
``prompt + response`` is encoded and ends with EOS, no chat template, and the response starts
where the encoded prompt and the encoded whole part (TRL's rule). Truncation keeps the prompt's
*tail* (``max_prompt_len``: the turn closest to the response matters most) and cuts the
responses on the right to ``max_seq_len``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttune.chat_messages import chat_message
from posttune.data.samples import SampleMaker, shared_start, shift_labels

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class PreferencePair:
    """One row of preference data: a prompt and two responses to it, as chat messages (all three) or text."""

    prompt: Messages | str
    chosen: Messages | str
    rejected: Messages | str


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

    def responses(self, prompt_messages: Messages | str,
                  responses: Sequence[Messages | str]) -> list[tuple[list[int], list[int]]] | None:
        """``(ids, labels)`` of each response after the prompt, the prompt masked (its tail kept under
        ``max_prompt_len``), cut to ``max_seq_len``; None when truncation leaves one with nothing to score.
        A preference pair has two responses; a method that scores a single response passes one. Messages are
        rendered with the chat template, text is encoded as is (`PreferencePair`)."""
        whole, start = (self._text(prompt_messages, responses) if isinstance(prompt_messages, str)
                        else self._rendered(prompt_messages, responses))
        cut = max(0, start - self.max_prompt_len) if self.max_prompt_len is not None else 0
        samples = []
        for ids, trained in whole:
            self.cut = self.cut or len(ids) - cut > self.max_seq_len  # a response's end past max_seq_len
            ids, trained = ids[cut:][: self.max_seq_len], trained[cut:][: self.max_seq_len]
            if not any(trained[1:]):  # truncation left nothing of this response to score
                return None
            samples.append((ids, shift_labels(ids, trained)))
        return samples

    def _rendered(self, prompt: Messages, responses: Sequence[Messages]) -> tuple[list[tuple[list, list]], int]:
        """Each response's ``(ids, trained)`` rendered after the prompt (whose tokens are untrained), and the
        prompt's length."""
        messages = self.with_system(prompt)
        start = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=self.tools)
        whole = []
        for response in responses:
            ids, trained = self.tokenizer.tokenize_messages([*messages, *response], tools=self.tools)
            if list(ids[: len(start)]) != list(start):
                raise ValueError("the chat template renders the prompt differently once a response follows it, "
                                 "so the prompt cannot be masked")
            whole.append((list(ids), [False] * len(start) + list(trained[len(start):])))
        return whole, len(start)

    def _text(self, prompt: str, responses: Sequence[str]) -> tuple[list[tuple[list, list]], int]:
        """Each ``prompt + response`` encoded, EOS after it (unless the text ends with it), trained from where the
        encoded prompt and the encoded wholes first differ (a token can merge across the boundary); that start."""
        eos, alone = self.tokenizer.eos_id, list(self.tokenizer.encode(prompt))
        whole = []
        for response in responses:
            ids = list(self.tokenizer.encode(prompt + response))
            whole.append(ids if eos is None or ids[-1:] == [eos] else [*ids, eos])
        start = min(shared_start(alone, ids) for ids in whole)
        return [(ids, [index >= start for index in range(len(ids))]) for ids in whole], start


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
    if row.get("prompt") is None and isinstance(row["chosen"], str) and isinstance(row["rejected"], str):
        raise ValueError("no 'prompt' field, and 'chosen' and 'rejected' are text, not conversations (TRL's standard "
                         "rows, whose prompt is their shared opening text: use format preference_text)")
    chosen = as_messages(row["chosen"], "chosen", "assistant")
    rejected = as_messages(row["rejected"], "rejected", "assistant")
    if row.get("prompt") is not None:
        return PreferencePair(as_messages(row["prompt"], "prompt", "user"), chosen, rejected)
    shared = shared_start(chosen, rejected)
    if shared == 0:
        raise ValueError("no 'prompt' field, and 'chosen' and 'rejected' share no first message to use as the "
                         "prompt")
    if shared == len(chosen) or shared == len(rejected):
        raise ValueError("'chosen' and 'rejected' are the same conversation up to the end of one of them: "
                         "nothing is left to compare")
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:])


def text_pair(row: Mapping[str, Any]) -> PreferencePair:
    """TRL's standard preference rows: ``prompt``, ``chosen`` and ``rejected`` as plain text, or no prompt and
    ``chosen``/``rejected`` sharing their opening text (``Anthropic/hh-rlhf``), which is the prompt: the shared
    characters, less a final space, which goes with the responses (as TRL's ``extract_prompt`` splits them)."""
    texts = {}
    for name in ("chosen", "rejected", "prompt"):
        value = row.get(name)
        if value is None and name != "prompt":
            raise KeyError(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"field '{name}' must be text in format preference_text, got {type(value).__name__} "
                             "(message lists: use format preference)")
        texts[name] = value
    chosen, rejected = texts["chosen"], texts["rejected"]
    if texts["prompt"] is not None:
        return PreferencePair(texts["prompt"], chosen, rejected)
    shared = shared_start(chosen, rejected)
    if shared == len(chosen) or shared == len(rejected):
        raise ValueError("no 'prompt' field, and 'chosen' and 'rejected' are the same text up to the end of one of "
                         "them: nothing is left to compare")
    if shared and chosen[shared - 1] == " ":
        shared -= 1
    if shared == 0:
        raise ValueError("no 'prompt' field, and 'chosen' and 'rejected' share no opening text to use as the prompt")
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:])
