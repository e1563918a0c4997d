"""Rows -> training samples: token ids and pre-shifted labels.

Label convention (the trainer and every method rely on it): ``labels[t]`` is the target of
position ``t``, i.e. the next token of the same sample when that token is trained on, else
``IGNORE_INDEX``. The last position of a sample never has a target, so when samples are packed
side by side no position predicts the first token of the next document, and a loss is plain
``cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")``.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from posttune.chat_messages import row_tools
from posttune.data.loading import rename
from posttune.descriptors import DatasetFormat
from posttune.errors import PosttuneError
from posttune.template_limits import TemplateLimitError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Sample:
    """One tokenized row: ``ids`` and ``labels`` (int64, same length) and the dataset row it came from."""

    ids: torch.Tensor
    labels: torch.Tensor
    row: int

    def __len__(self) -> int:
        return self.ids.numel()


@dataclass(frozen=True)
class PromptCompletion:
    """A prompt and its completion (TRL's prompt-completion rows), of which only the completion trains: both
    text (no chat template: the completion and EOS train) or both messages (the completion's assistant turns)."""

    prompt: str | list[dict[str, Any]]
    completion: str | list[dict[str, Any]]


@dataclass
class SkipCounts:
    """Rows left out of training, for the trainer's end-of-run report.

    ``bad_rows``: the format could not read the row (``skip_bad_rows: true``); ``untrained``: no
    token was left to train on after truncation to ``max_seq_len``. A row is counted once even when
    a streaming dataset is read again (next epoch, resume): ``upto`` is the first row not yet counted.
    """

    bad_rows: int = 0
    untrained: int = 0
    truncated: int = 0  # kept, but cut to max_seq_len: their end does not train (not a skip: not in ``total``)
    split: int = 0  # kept whole, in pieces of max_seq_len (``split_long``): every token trains
    empty: int = 0  # kept, but the response is empty: only the end token trains (a CSV's empty cell is "")
    upto: int = 0
    first_bad: str = ""  # the first bad row skipped and why, as the error would have said it (not checkpointed)

    def record(self, kind: str, row: int) -> None:
        if row >= self.upto:
            setattr(self, kind, getattr(self, kind) + 1)
            self.upto = row + 1

    @property
    def total(self) -> int:
        return self.bad_rows + self.untrained

    def state_dict(self) -> dict[str, int]:
        return {key: value for key, value in asdict(self).items() if key != "first_bad"}


def _empty_response(content: Any) -> bool:
    """Whether what trains in ``content`` is empty text: every trained assistant turn (or the completion, or the
    text) blank, with no tool call. TRL trains such rows too (the end token only); they are counted, not dropped."""
    if isinstance(content, PromptCompletion):
        content = content.completion
    if isinstance(content, str):
        return not content.strip()
    turns = [turn for turn in content if isinstance(turn, Mapping) and turn.get("role") == "assistant"
             and turn.get("weight", 1) != 0] if isinstance(content, list) else []
    return bool(turns) and all(isinstance(turn.get("content") or "", str) and not (turn.get("content") or "").strip()
                               and not turn.get("tool_calls") for turn in turns)


def _text_size(value: Any) -> int:
    """The characters of a row's strings, at every depth."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_text_size(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(item) for item in value)
    return 0


def shift_labels(ids: Sequence[int], trained: Sequence[bool]) -> list[int]:
    """``labels[t] = ids[t + 1]`` where token t+1 is trained on, else IGNORE_INDEX; the last is ignored."""
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    return labels + [IGNORE_INDEX] if ids else []


class SampleMaker:
    """Turns dataset rows into (ids, labels) with a format and a tokenizer, reporting bad rows by index.

    For ``conversation`` rows; ``PairMaker`` (``preference.py``) reuses its row handling for preference pairs.
    """

    kind = "conversation"

    def __init__(self, fmt: DatasetFormat, tokenizer: Any, *, max_seq_len: int, train_on_input: bool = False,
                 skip_bad_rows: bool = False, column_map: Mapping[str, str] | None = None,
                 where: str = "data.train", skipped: SkipCounts | None = None, system_prompt: str | None = None,
                 split_long: bool = False):
        if fmt.kind != self.kind:
            raise PosttuneError(f"{where}: format '{fmt.name}' gives {fmt.kind} rows; this data needs a "
                                f"{self.kind} format")
        self.fmt, self.tokenizer = fmt, tokenizer
        self.max_seq_len, self.train_on_input = max_seq_len, train_on_input
        self.skip_bad_rows, self.column_map, self.where = skip_bad_rows, dict(column_map or {}), where
        self.skipped = skipped if skipped is not None else SkipCounts()
        self.system_prompt = system_prompt
        # a sample past max_seq_len becomes consecutive pieces of max_seq_len tokens, each its own group (continued
        # pretraining on long documents): the labels are shifted before the cut, so each piece's last position
        # predicts the next piece's first token and every trained token trains exactly once (torchtune's
        # split_across_pack keeps the tail the same way); a piece's attention starts at its own first token
        self.split_long = split_long
        self.tools: list[dict[str, Any]] | None = None  # the current row's tool definitions (`row_tools`)
        self.first_row = 0  # the number of this dataset's first row among all the run reads (a mixture's)
        self.cut = False  # whether the current row ran past max_seq_len (set by `make`, counted by `__call__`)
        self.unmapped = False  # whether the current row's problem is a column named otherwise (`_problem`)

    def for_source(self, dataset: Any, fmt: DatasetFormat, where: str, first_row: int) -> SampleMaker:
        """This maker reading another dataset of a mixture (``data.train[i]``): its format, ``column_map``
        and system prompt, its rows numbered on from ``first_row`` (errors still say the dataset's own row)."""
        if fmt.kind != self.kind:
            raise PosttuneError(f"{where}: format '{fmt.name}' gives {fmt.kind} rows; this data needs a "
                                f"{self.kind} format")
        other = copy.copy(self)
        other.fmt, other.column_map, other.system_prompt = fmt, dict(dataset.column_map), dataset.system_prompt
        other.where, other.first_row = where, first_row
        return other

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the configured system turn first, unless they open with their own."""
        if self.system_prompt is None or (messages and messages[0].get("role") == "system"):
            return list(messages)
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def __call__(self, row: Mapping[str, Any], index: int) -> Any:
        """What a row becomes (here: ``(ids, labels)``), or None when it is skipped (and counted)."""
        self.cut = False  # set by `make` when the row's tokens ran past max_seq_len
        self.unmapped = False  # set by `_problem` when the first row names the format's fields otherwise
        try:
            row = rename(row, self.column_map)
            self.tools = row_tools(row)  # the row's `tools` reach the chat template with its messages
            content = self.fmt.transform(row)
            made = self.make(content)
        except (KeyError, ValueError) as exc:
            return self._bad(index, self._problem(exc, row, index))
        except TemplateLimitError as exc:  # the template is at fault, not the row: skipping rows would not help
            limit = getattr(getattr(self.tokenizer, "render_limits", None), "max_chars", None)
            size = _text_size(row)
            if limit is not None and size * 2 > limit:  # unless the row alone is half the budget
                return self._bad(index, f"its text ({size:,} characters) is too long for the chat template's "
                                        f"render budget ({exc})")
            raise TemplateLimitError(f"{self.where}: row {index - self.first_row}: {exc}") from None
        except PosttuneError as exc:  # the chat template refused these messages
            if getattr(self.tokenizer, "chat_template", True) is None:
                raise PosttuneError(f"{self.where}: format '{self.fmt.name}' gives chat messages: {exc}") from None
            return self._bad(index, str(exc))
        if made is None:  # no token left to train on
            self.skipped.record("untrained", index)
        elif self.cut and self.split_long:
            self.skipped.record("split", index)
        elif self.cut:
            self.skipped.record("truncated", index)
        elif _empty_response(content):
            self.skipped.record("empty", index)
        return made

    def make(self, content: Any) -> tuple[list[int], list[int]] | list[list[tuple[list[int], list[int]]]] | None:
        """(ids, pre-shifted labels) of one transformed row, cut to ``max_seq_len`` (or, ``split_long``, its pieces:
        one group each); None when no token is trained on."""
        if isinstance(content, str) and not content.strip():  # a blank document (a .txt file's empty line)
            return None
        ids, trained = self._tokenize(content)
        self.cut = len(ids) > self.max_seq_len
        if self.cut and self.split_long:
            labels, size = shift_labels(ids, trained), self.max_seq_len
            pieces = [[(ids[i:i + size], labels[i:i + size])] for i in range(0, len(ids), size)
                      if any(label != IGNORE_INDEX for label in labels[i:i + size])]
            return pieces or None
        ids, trained = ids[: self.max_seq_len], trained[: self.max_seq_len]
        if not any(trained[1:]):  # the first token is never a target
            return None
        return ids, shift_labels(ids, trained)

    def _tokenize(self, content: Any) -> tuple[list[int], list[bool]]:
        if isinstance(content, PromptCompletion):
            return self._prompt_completion(content)
        if isinstance(content, str):  # completion-style text: every token is trained on, then one EOS
            eos, ids = self.tokenizer.eos_id, list(self.tokenizer.encode(content))
            if eos is not None and ids[-1:] != [eos]:  # TRL's rule: not twice, if the text or the tokenizer put one
                ids.append(eos)
            return ids, [True] * len(ids)
        ids, trained = self.tokenizer.tokenize_messages(self.with_system(content), train_on_input=self.train_on_input,
                                                        tools=self.tools)
        return list(ids), list(trained)

    def _prompt_completion(self, content: PromptCompletion) -> tuple[list[int], list[bool]]:
        """The whole row tokenized and, unless ``train_on_input``, its first tokens untrained: those it shares with
        the prompt alone (text: encoded; messages: rendered with the generation prompt), as TRL counts them. Where
        the two part before the prompt's end (a token merged across the boundary: "Answer: " + "Paris" encodes
        " Paris"), the completion trains from there: counting the prompt's tokens would leave its first untrained."""
        if isinstance(content.prompt, str):
            ids, trained = self._tokenize(content.prompt + content.completion)  # text: every token, then EOS
            alone = self.tokenizer.encode(content.prompt)
        else:
            ids, trained = self._tokenize([*content.prompt, *content.completion])
            alone = self.tokenizer.apply_chat_template(self.with_system(content.prompt), tools=self.tools,
                                                       add_generation_prompt=True)
        prompt = shared_start(alone, ids)
        if not self.train_on_input:
            trained = [flag and i >= prompt for i, flag in enumerate(trained)]
        return ids, trained

    def _problem(self, exc: KeyError | ValueError, row: Mapping[str, Any], index: int) -> str:
        if isinstance(exc, KeyError):
            field = exc.args[0] if exc.args else "?"
            column = self.column_map.get(field)
            # a row read through Arrow holds every field of the file, absent ones as null: which of the two is unknown
            null = " (absent or null)" if isinstance(row, Mapping) and field in row else ""
            if isinstance(row, Mapping) and field not in row and column is None and index == self.first_row \
                    and field in self.fmt.columns:  # the file's first row lacks a format's field: named otherwise
                self.unmapped = True
                return (f"missing field '{field}' (the row's fields: {', '.join(map(str, row)) or 'none'}; "
                        f"{self.where}.column_map: {{{field}: <one of them>}} names the column to read)")
            return f"missing field '{field}'{null}" + (f" (column '{column}' in column_map)" if column else "")
        return str(exc)

    def _bad(self, index: int, problem: str) -> None:
        if not self.skip_bad_rows:  # a column named otherwise is no bad row: skipping it would skip them all
            advice = "" if self.unmapped else " (set data.skip_bad_rows: true to skip such rows)"
            raise PosttuneError(f"{self.where}: row {index - self.first_row}: {problem}{advice}")
        self.skipped.record("bad_rows", index)
        self.skipped.first_bad = self.skipped.first_bad or f"{self.where}: row {index - self.first_row}: {problem}"
        return None

    def samples(self, rows: Iterable[Mapping[str, Any]], *, start: int = 0) -> Iterable[Sample]:
        """Lazily: the samples of ``rows``, numbered from ``start`` (for streaming datasets)."""
        for group in self.groups(rows, start=start):
            yield from group

    def groups(self, rows: Iterable[Mapping[str, Any]], *, start: int = 0) -> Iterable[list[Sample]]:
        """Lazily: each kept row's samples (a group), numbered from ``start`` (for streaming datasets)."""
        for index, row in enumerate(rows, start):
            for group in made_groups(self(row, index)):
                yield [Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long), index)
                       for ids, labels in group]


def shared_start(first: Sequence[Any], second: Sequence[Any]) -> int:
    """How many leading items ``first`` and ``second`` share."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return shared


def made_groups(made: Any) -> list[list[tuple[Sequence[int], Sequence[int]]]]:
    """What a maker returned for one row, as groups of (ids, labels): ``(ids, labels)`` is one group of one sample,
    a list of such pairs one group (a preference pair), a list of such lists several groups (a row in pieces)."""
    if made is None:
        return []
    if isinstance(made, tuple):
        return [[made]]
    return made if made and isinstance(made[0], list) else [made]


class SampleStore:
    """Every sample of a map-style dataset, tokenized once, as flat int32 tensors plus offsets.

    A dataset row gives a *group* of samples: one for SFT, two (chosen, rejected) for a
    preference pair. ``group(i)`` returns the i-th kept row's samples, ``row_of(i)`` its index in
    the dataset. Flat storage keeps memory near 8 bytes per token (Python lists of ints take
    ~10x that), so an epoch never re-tokenizes and a large dataset still fits.
    """

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor,
                 groups: torch.Tensor | None = None):
        self.ids, self.labels, self.offsets, self.rows = ids, labels, offsets, rows
        # groups[i]..groups[i + 1]: the samples of kept row i (one sample per row when not given)
        self.groups = groups if groups is not None else torch.arange(len(rows) + 1, dtype=torch.int64)

    @classmethod
    def build(cls, rows: Iterable[Mapping[str, Any]], make: Any) -> SampleStore:
        """Tokenize every row with ``make(row, index)``: ``(ids, labels)``, a list of such pairs (a group), a list
        of groups (a row in pieces) or None for a skipped row (`made_groups`)."""
        ids, labels, offsets, kept, groups = array("i"), array("i"), array("q", [0]), array("q"), array("q", [0])
        for index, row in enumerate(rows):
            for group in made_groups(make(row, index)):
                for sample_ids, sample_labels in group:
                    ids.extend(sample_ids)
                    labels.extend(sample_labels)
                    offsets.append(len(ids))
                kept.append(index)
                groups.append(len(offsets) - 1)
        return cls(_tensor(ids, torch.int32), _tensor(labels, torch.int32), _tensor(offsets, torch.int64),
                   _tensor(kept, torch.int64), _tensor(groups, torch.int64))

    def __len__(self) -> int:
        """Kept rows (groups)."""
        return self.rows.numel()

    def length(self, index: int) -> int:
        """Tokens of row ``index``'s first sample (all of them for SFT): what packing needs."""
        first = int(self.groups[index])
        return int(self.offsets[first + 1] - self.offsets[first])

    def group_lengths(self) -> torch.Tensor:
        """Each kept row's longest sample, from the offsets (no re-tokenizing): how wide the row pads."""
        sample_lengths = self.offsets[1:] - self.offsets[:-1]
        owner = torch.repeat_interleave(torch.arange(len(self)), self.groups[1:] - self.groups[:-1])
        return torch.zeros(len(self), dtype=torch.int64).scatter_reduce(0, owner, sample_lengths, "amax")

    def sample(self, position: int, row: int) -> Sample:
        start, end = int(self.offsets[position]), int(self.offsets[position + 1])
        return Sample(self.ids[start:end].long(), self.labels[start:end].long(), row)

    def group(self, index: int) -> list[Sample]:
        """The samples of kept row ``index`` (SFT: one; a preference pair: chosen, rejected)."""
        row = int(self.rows[index])
        return [self.sample(p, row) for p in range(int(self.groups[index]), int(self.groups[index + 1]))]

    def __getitem__(self, index: int) -> Sample:
        """The first sample of kept row ``index`` (the only one for SFT)."""
        return self.group(index)[0]


def _tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """The array's memory as a tensor, shared, not copied (the tensor keeps the array alive): a copy held both at
    once, twice the store's 8 bytes a token at its peak."""
    return torch.frombuffer(values, dtype=dtype) if len(values) else torch.zeros(0, dtype=dtype)
