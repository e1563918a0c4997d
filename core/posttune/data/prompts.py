"""Prompt data: rows -> prompts to generate from, with every other field of the row kept.

What online methods (GRPO, on-policy distillation) consume: a ``prompt`` format's transform
returns a :class:`PromptRow` (the prompt as the row gave it, its chat messages, and the row's
other fields, e.g. ``answer``, untouched: they reach the reward functions). The prompt is
rendered with the checkpoint's chat template and its generation prompt (or encoded as plain
text when the tokenizer has no template) and cut to its last ``max_prompt_len`` tokens: the
end of a prompt, next to where the answer starts, matters most.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from posttune.data.samples import SampleMaker


@dataclass(frozen=True)
class PromptRow:
    """One row of prompt data, as a ``prompt`` format's transform returns it."""

    prompt: Any  # the prompt as the row held it (a string or a list of messages): what rewards see
    messages: list[dict[str, Any]]  # the same as chat messages, for the chat template
    fields: dict[str, Any] = field(default_factory=dict)  # every other field of the row


@dataclass(frozen=True)
class PromptSample:
    """A tokenized prompt: its ids, what rewards see of it, its row's fields and its row index."""

    ids: torch.Tensor
    prompt: Any
    fields: dict[str, Any]
    row: int

    def __len__(self) -> int:
        return self.ids.numel()


class PromptMaker(SampleMaker):
    """Turns prompt rows into ``PromptSample``s; row errors and skip counts are ``SampleMaker``'s."""

    kind = "prompt"

    def __init__(self, fmt: Any, tokenizer: Any, *, max_prompt_len: int | None = None, **kwargs: Any):
        super().__init__(fmt, tokenizer, max_seq_len=max_prompt_len or 0, **kwargs)
        self.max_prompt_len = max_prompt_len

    def make(self, row: PromptRow) -> tuple[list[int], PromptRow] | None:
        if self.tokenizer.chat_template is not None:
            self.tokenizer.check_tool_use(row.messages, self.tools)
            ids = list(self.tokenizer.apply_chat_template(self.with_system(row.messages), add_generation_prompt=True,
                                                          tools=self.tools))
        elif isinstance(row.prompt, str):
            ids = list(self.tokenizer.encode(row.prompt))
        else:
            raise ValueError("the prompt is a list of messages but the tokenizer has no chat template")
        if self.max_prompt_len is not None:
            ids = ids[-self.max_prompt_len:]
        return (ids, row) if ids else None

    def groups(self, rows: Iterable[Mapping[str, Any]], *, start: int = 0) -> Iterable[list[PromptSample]]:
        for index, row in enumerate(rows, start):
            made = self(row, index)
            if made is not None:
                ids, prompt = made
                yield [PromptSample(torch.tensor(ids, dtype=torch.long), prompt.prompt, prompt.fields, index)]


def prompt_batch(rows: list[list[PromptSample]]) -> dict[str, Any]:
    """Prompts side by side, not padded (generation pads them its own way).

    ``prompt_ids``: a list of 1-D LongTensors; ``prompts``: what rewards see; ``fields``: each
    field of the rows as a list; ``rows``: LongTensor of dataset rows (empty for an empty share:
    a rank with no prompts still takes part in every collective of a step).
    """
    samples = [row[0] for row in rows]
    names = sorted({name for sample in samples for name in sample.fields})
    return {
        "prompt_ids": [sample.ids for sample in samples],
        "prompts": [sample.prompt for sample in samples],
        "fields": {name: [sample.fields.get(name) for sample in samples] for name in names},
        "rows": torch.tensor([sample.row for sample in samples], dtype=torch.long),
    }


def prompt_row(row: Mapping[str, Any]) -> PromptRow:
    """A row with a ``prompt`` (a string: one user turn, or messages); its other fields kept."""
    from posttune.data.preference import as_messages

    if row.get("prompt") is None:
        raise KeyError("prompt")
    messages = as_messages(row["prompt"], "prompt", "user")
    return PromptRow(row["prompt"], messages, {key: value for key, value in row.items() if key != "prompt"})
