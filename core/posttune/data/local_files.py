"""Local dataset files, checked before `datasets` reads them and explained when it cannot.

Left to `datasets`, each of these surfaces late or unreadably: bytes that are not UTF-8 are
stored in string columns without complaint and raise ``UnicodeDecodeError`` when a row is
first read, mid-run; an empty file raises ``StopIteration``; a ``.json`` file holding one object
(rows nested under a key) loads as one row with a column named after the key; an invalid JSON
line is "An error occurred while generating the dataset". Here each is one line naming the file
and the line. With ``data.skip_bad_rows`` the bad lines of line-based files (JSON Lines, text)
are dropped from a cleaned copy and counted with the other skipped rows instead. The check
reads each file once more, in chunks (decoding runs at disk speed); parsing line by line in
Python happens only on the error path, or with ``skip_bad_rows`` for JSON Lines.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from posttune.config.data_checks import BOM, json_kind, line_problem
from posttune.errors import ConfigError, PosttuneError, first_line

CHUNK = 1 << 24  # bytes read at a time when checking that a file is UTF-8
_cleaned_dir: Path | None = None


def check_files(files: list[str], builder: str, where: str, *,
                skip_bad_rows: bool) -> tuple[list[str], int, str]:
    """The files to hand to `datasets` (cleaned copies where rows were dropped), how many rows were dropped, and the
    first of them with why ("" when none)."""
    kept, dropped, first = [], 0, ""
    for name in files:
        path = Path(name)
        if builder == "parquet":  # binary, checked by its own reader
            kept.append(name)
            continue
        empty, bad_line = _scan_utf8(path)
        if empty:
            raise ConfigError(f"{where}.path", f"{path}: the file is empty (no rows)")
        lines = builder == "text" or (builder == "json" and _json_layout(path, where, skip_bad_rows) == "lines")
        if skip_bad_rows and lines and (bad_line is not None or builder == "json"):
            name, count, problem = _clean_copy(path, builder)
            dropped, first = dropped + count, first or problem
        elif bad_line is not None:
            hint = " (or set data.skip_bad_rows: true to skip such rows)" if lines else ""
            raise ConfigError(f"{where}.path", f"{path}: line {bad_line}: not UTF-8 text; save the file as "
                                               f"UTF-8{hint}")
        kept.append(name)
    return kept, dropped, first


def explain_failure(files: list[str], builder: str) -> str | None:
    """Why `datasets` could not read these JSON files, naming the file and line; None when not found here."""
    if builder != "json":
        return None
    for name in files:
        problem = _json_problem(Path(name))
        if problem is not None:
            return problem
    return None


def guarded(rows: Iterable[Any], where: str, start: int = 0, explain: Any = None) -> Iterator[Any]:
    """``rows``, with a failure to *read* them (undecodable text in a hub or parquet dataset, a bad line
    of a streamed file) raised as one line instead of a traceback. Readers fail a block at a time, so
    the count of rows read before is what is known for sure; the reader's own message may say more, and a local
    stream's files (``explain``, else the rows' ``posttune_explain``: `explain_failure`) name the file and line."""
    iterator, index = iter(rows), start
    explain = explain or getattr(rows, "posttune_explain", None)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - whatever the reader raises, it is this row's data
            found = explain() if explain is not None else None
            if found is not None:
                raise PosttuneError(f"{where}: {found}") from None
            raise PosttuneError(f"{where}: reading the dataset failed after {index} row(s): {type(exc).__name__}: "
                                f"{first_line(str(exc)) or 'no message'}") from None
        yield row
        index += 1


def _scan_utf8(path: Path) -> tuple[bool, int | None]:
    """(whether the file holds only whitespace, the first line that is not UTF-8 or None), read in chunks."""
    empty, line, carry = True, 1, b""
    with path.open("rb") as handle:
        while True:
            chunk = handle.read(CHUNK)
            data = carry + chunk
            cut = len(data) if not chunk else data.rfind(b"\n") + 1  # decode whole lines only
            piece, carry = data[:cut], data[cut:]
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError as exc:
                return False, line + piece[:exc.start].count(b"\n")
            empty = empty and not piece.strip()
            line += piece.count(b"\n")
            if not chunk:
                return empty, None


def _json_layout(path: Path, where: str, skip_bad_rows: bool = False) -> str:
    """``"lines"`` (JSON Lines) or ``"document"`` (one JSON list over the file); one object is refused,
    and so is a first line that is no object unless ``skip_bad_rows`` drops it."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        first = next((line for line in handle if line.strip()), "").removeprefix(BOM)
        second = next((line for line in handle if line.strip()), None)
    if first.lstrip().startswith("["):
        return "document"
    try:
        value = json.loads(first)
    except RecursionError:  # refused here: Arrow's JSON reader may crash the process on it
        if skip_bad_rows:
            return "lines"  # `_clean_copy` drops it (`line_problem` names it)
        number = next(i for i, line in enumerate(_lines(path), 1) if line.strip())
        raise ConfigError(f"{where}.path", f"{path}: line {number}: nested too deeply to read (thousands of "
                                           "levels)") from None
    except json.JSONDecodeError:
        try:
            value = json.loads(path.read_text(encoding="utf-8", errors="replace").removeprefix(BOM))
        except json.JSONDecodeError:
            return "lines"  # broken either way: `datasets` fails and `explain_failure` names the line
        if isinstance(value, dict):
            raise ConfigError(f"{where}.path", _one_object(path, value, "spread over several lines")) from None
        return "document"
    if second is None and isinstance(value, dict) and path.suffix == ".json":
        raise ConfigError(f"{where}.path", _one_object(path, value, "on one line"))
    if not isinstance(value, dict) and not skip_bad_rows:  # a first line `null` crashes pyarrow's reader
        number = next(i for i, line in enumerate(_lines(path), 1) if line.strip())
        raise ConfigError(f"{where}.path", f"{path}: line {number}: expected a JSON object (one row), "
                                           f"got {json_kind(value)}")
    return "lines"


def _lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as handle:
        yield from handle


def _one_object(path: Path, value: dict[str, Any], how: str) -> str:
    keys = ", ".join(map(str, list(value)[:5])) or "none"
    return (f"{path}: holds one JSON object {how} (keys: {keys}), not a list of rows; write a JSON list of rows "
            f"([{{...}}, {{...}}]) or one row per line in a .jsonl file")


def _json_problem(path: Path) -> str | None:
    text = path.read_text(encoding="utf-8", errors="replace").removeprefix(BOM)
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"{path}: line {exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})"
        except RecursionError:
            return f"{path}: nested too deeply to read (thousands of levels)"
        if isinstance(value, list) and not any(value):
            return f"{path}: holds no rows (an empty list, or only empty objects)"
        bad = next((i for i, item in enumerate(value) if not isinstance(item, dict)), None) \
            if isinstance(value, list) else None
        return None if bad is None else \
            f"{path}: item {bad}: expected a JSON object (one row), got {json_kind(value[bad])}"
    fields = False
    for number, line in enumerate(text.split("\n"), 1):
        problem = line_problem(line)
        if problem is not None:
            return f"{path}: line {number}: {problem}"
        fields = fields or bool(line.strip() not in ("", "{}"))
    return None if fields else f"{path}: holds no rows with any field (only empty objects)"


def _clean_copy(path: Path, builder: str) -> tuple[str, int, str]:
    """A copy of a line-based file without its unreadable lines (undecodable; for JSON, not an object), how many
    were dropped and the first of them with why, as the error without ``skip_bad_rows`` would name it."""
    kept, dropped, first = [], 0, ""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                problem = "not UTF-8 text"
            else:
                problem = line_problem(text) if builder == "json" else None
            if problem is None:
                kept.append(raw)
                continue
            dropped, first = dropped + 1, first or f"{path}: line {number}: {problem}"
    if not dropped:
        return str(path), 0, ""
    if not any(line.strip() for line in kept):
        raise PosttuneError(f"{path}: no readable rows ({dropped} skipped as undecodable or invalid)")
    copy = _scratch() / f"{len(list(_scratch().iterdir()))}-{path.name}"
    copy.write_bytes(b"".join(kept))
    return str(copy), dropped, first


def cleaned(files: list[str]) -> bool:
    """Whether some of ``files`` are cleaned copies: `datasets` then caches its Arrow copy with them (`scratch`),
    not in its own cache, where a copy of another name each run would add an entry never read again."""
    return _cleaned_dir is not None and any(Path(name).parent == _cleaned_dir for name in files)


def scratch_cache() -> str:
    return str(_scratch() / "arrow-cache")


def _scratch() -> Path:
    """A folder for cleaned copies, removed when the process ends (a streamed copy is read until then)."""
    global _cleaned_dir
    if _cleaned_dir is None:
        _cleaned_dir = Path(tempfile.mkdtemp(prefix="posttune-rows-"))
        atexit.register(shutil.rmtree, _cleaned_dir, True)
    return _cleaned_dir
