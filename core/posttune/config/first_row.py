"""Read the first row of a local JSON Lines dataset with its format, before any weight loads.

``posttune validate`` (and ``train``, before composing) calls ``check_first_rows``: a format
that cannot read the data (``format: chat`` on alpaca rows, a missing column) is refused in one
line naming ``data.<split>.format``, instead of after the model was built. Only a local ``.jsonl``
file is peeked at (one line, no `datasets` import); other sources are read when the run loads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttune.errors import ConfigError


def check_first_rows(plan: Any) -> None:
    """Each split's format must read the first row of its local ``.jsonl`` file (unless bad rows
    are to be skipped: the first row may be one of them)."""
    if plan.config.data.skip_bad_rows:
        return
    for split, fmt in plan.datasets.items():
        dataset = getattr(plan.config.data, split, None)
        row = first_jsonl_row(Path(dataset.path).expanduser()) if dataset is not None else None
        if row is None:
            continue
        renamed = dict(row)
        for field, column in dataset.column_map.items():
            renamed[field] = row.get(column)
        try:
            fmt.descriptor.transform(renamed)
        except (KeyError, ValueError, TypeError) as exc:
            shown = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise ConfigError(f"data.{split}.format",
                              f"'{dataset.format}' cannot read the first row of {dataset.path} ({shown}; the row "
                              f"has {', '.join(map(repr, row)) or 'no fields'}); choose the format that matches "
                              "the data, or map its columns with column_map") from None


def first_jsonl_row(path: Path) -> dict[str, Any] | None:
    """The first non-empty line of a ``.jsonl`` file as a mapping; None for anything else (other
    file types, folders, a line that is not a JSON object: the loader reports those itself)."""
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    return None
                return row if isinstance(row, dict) else None
    return None
