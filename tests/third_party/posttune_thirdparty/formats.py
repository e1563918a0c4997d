"""Dataset formats of the core's own kinds, as a third party writes them for its data's layout.

    data:
      train: {path: judgements.jsonl, format: judged}     # DPO: {"question", "better", "worse"}
      train: {path: tasks.jsonl, format: task}             # GRPO: {"task", "answer", ...}

A format of kind ``preference`` returns a ``PreferencePair`` of message lists, one of kind
``prompt`` a ``PromptRow``; ``as_messages`` turns a field (a string, or a list of messages) into
checked messages, so a malformed row fails with the field's name. Any method that reads the kind
(DPO, GRPO) then reads these rows with no change to it or to the core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.plugin import DatasetFormat, PreferencePair, PromptRow, as_messages


def judged(row: Mapping[str, Any]) -> PreferencePair:
    """``{"question", "better", "worse"}``: the question as the user's turn, each answer as the assistant's."""
    question = as_messages(row["question"], "question", "user")
    return PreferencePair(question, as_messages(row["better"], "better", "assistant"),
                          as_messages(row["worse"], "worse", "assistant"))


def task(row: Mapping[str, Any]) -> PromptRow:
    """``{"task", ...}``: the task as the user's turn; every other field reaches the reward functions."""
    return PromptRow(row["task"], as_messages(row["task"], "task", "user"),
                     {key: value for key, value in row.items() if key != "task"})


FORMATS = (
    DatasetFormat("judged", "preference", judged, ("question", "better", "worse"),
                  "a question with a better and a worse answer (a third-party example)"),
    DatasetFormat("task", "prompt", task, ("task",), "a task to answer, other fields for the rewards (example)"),
)


def register_datasets(register: Any) -> None:
    for fmt in FORMATS:
        register(fmt)
