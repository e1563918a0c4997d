"""The data a run will read, checked before any weight loads: its paths, and its first row.

``posttune validate`` (and ``train``, before composing) calls ``check_data``: a local path that
does not exist, a folder with no data files (or of mixed types), and a format that cannot read the
first row (``format: chat`` on alpaca rows, a missing column) are refused in one line naming the
field, instead of after the model was built. Only a local ``.jsonl`` or ``.csv`` file's first row is peeked at
(one line, no `datasets` import); hub datasets are reached when the run loads them. Torch-free:
the loader (``posttune.data.loading``) uses the same path rules.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttune import hub
from posttune.chat_messages import row_tools
from posttune.errors import ConfigError

#: file extension -> the `datasets` packaged builder that reads it
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
#: why a run whose model is built from a size needs ``tokenizer.path`` (validate and compose say the same)
NO_TOKENIZER = "required when the model is built from a size (no model.path)"
# "name" or "owner/name", as the hub spells dataset ids; anything else is meant as a local path
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_data(plan: Any, *, runs: bool = True) -> None:
    """Every dataset the run reads exists (a local one holds data files), each split's format reads
    its first row, and a local tokenizer loads. ``runs``: the config is about to train (``validate``,
    ``train``), so it must name a tokenizer; ``plan`` and ``config show`` need none."""
    for where, (dataset, _) in plan.sources.items():
        if (path := local_path(dataset, where)) is not None and not saved_by_datasets(path):
            local_files(path, where)
            local_split(dataset.split, where)
            if dataset.subset is not None:  # a hub dataset's configuration: local files have none
                override = where.replace("[", ".").rstrip("]")  # data.train[1] -> data.train.1 on the command line
                raise ConfigError(f"{where}.subset", f"{dataset.subset!r}: local files have no subsets (a hub "
                                                     "dataset's configuration name); point path at that subset's "
                                                     f"own files and drop it ({override}.subset=null)")
    chats = check_first_rows(plan)
    check_tokenizer(plan.config, required=runs, chats=chats)


def check_tokenizer(config: Any, *, required: bool = True, chats: str | None = None) -> None:
    """The tokenizer the run loads: ``tokenizer.path`` (a local folder is read now, a hub id when the
    run starts), else the one in ``model.path``'s folder once it exists (a bundled example's model
    is made by its ``prepare`` step; the run refuses a missing one in one line before any weight loads).
    A model built from a size has no folder: a run needs ``tokenizer.path`` (``required``). ``chats``: the data
    section whose rows are chat messages, which a tokenizer without a chat template cannot render."""
    from posttune.checkpoint.source import is_hub_id

    if config.tokenizer.chat_template is not None:
        from posttune.tokenizer_files import chat_template_override

        chat_template_override(config.tokenizer.chat_template)
    from posttune.chat_template import RENDER_VARIABLES

    for name in config.tokenizer.chat_template_kwargs:
        if name in RENDER_VARIABLES:
            raise ConfigError(f"tokenizer.chat_template_kwargs.{name}", "set by posttune for each render (the row's "
                                                                       "messages and tools, the generation prompt)")
    field = "tokenizer.path" if config.tokenizer.path is not None else "model.path"
    path = config.tokenizer.path or config.model.path
    if path is None:  # a model built from a size has no folder to read one from
        if required:
            raise ConfigError("tokenizer.path", NO_TOKENIZER)
        return
    if is_hub_id(str(path)) or (field == "model.path" and not Path(str(path)).expanduser().is_dir()):
        return
    from posttune.errors import PosttuneError
    from posttune.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except PosttuneError as exc:
        raise ConfigError(field, str(exc).removeprefix("tokenizer: ")) from None
    if chats is not None and tokenizer.chat_template is None and config.tokenizer.chat_template is None:
        raise ConfigError(field, f"{path} has no chat template, and {chats} holds chat messages (a string of a "
                                 "prompt or preference row is one turn): set tokenizer.chat_template (a .jinja file "
                                 "or the template), or use plain text rows (format text, completion or "
                                 "preference_text)")


def local_path(dataset: Any, where: str) -> Path | None:
    """The local file or folder ``dataset.path`` names; None for a hub dataset name. A path that does
    not exist and does not look like a hub name is one line naming the field."""
    path = Path(dataset.path).expanduser()
    if path.exists():
        return path
    if path.suffix in BUILDERS or not _HUB_NAME.match(dataset.path) or hub.first_part_exists(dataset.path):
        relative = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise ConfigError(f"{where}.path", f"no such file or directory {dataset.path!r}{relative}")
    return None


def saved_by_datasets(path: Path) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` (state.json) or ``DatasetDict.save_to_disk``
    (dataset_dict.json) wrote: Arrow files ``datasets.load_from_disk`` reads, not data files."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def local_files(path: Path, where: str) -> tuple[str, list[str]]:
    """The builder and the sorted data files of a file or a folder (searched recursively)."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ConfigError(f"{where}.path", f"{path} holds no {'/'.join(_extensions())} files")
    builders = {BUILDERS.get(p.suffix) for p in files}
    if None in builders:
        raise ConfigError(f"{where}.path", f"cannot read {path.suffix or 'extension-less'} files "
                                           f"(expected one of {', '.join(_extensions())})")
    if len(builders) > 1:
        raise ConfigError(f"{where}.path", f"{path} mixes file types ({', '.join(sorted(builders))}); "
                                           f"keep one type per folder")
    return builders.pop(), [str(p) for p in files]


def local_split(split: str, where: str) -> str:
    """The split `datasets` reads local files as: one, named "train", a slice of it (``train[:90%]``) kept.
    Another name is refused rather than ignored: a folder holding a hub dataset's splits (``train_sft-*``,
    ``test_sft-*``) would otherwise be read whole, its test rows trained on."""
    name, bracket, rest = split.partition("[")
    if name.strip() != "train":
        raise ConfigError(f"{where}.split", f"{split!r}: local files are read as one split, 'train' (slices such "
                                            "as train[:90%] work); point path at that split's own files")
    return "train" + bracket + rest


def _extensions() -> list[str]:
    return [ext.lstrip(".") for ext in BUILDERS]


def check_first_rows(plan: Any) -> str | None:
    """Each split's local ``.jsonl`` (or ``.csv``, ``.parquet``) file has a row, its first line is one (unless bad
    rows are to be skipped: the first may be one of them), and the format reads it; returns the first data section
    whose first row became chat messages (a chat template renders them), or None."""
    skip, chats = plan.config.data.skip_bad_rows, None
    for where, (dataset, fmt) in plan.sources.items():
        path = Path(dataset.path).expanduser()
        row = (first_jsonl_row(path, f"{where}.path", strict=not skip) or first_csv_row(path, f"{where}.path")
               or first_parquet_row(path, f"{where}.path"))
        if row is None or skip:
            continue
        renamed = dict(row)
        for field, column in dataset.column_map.items():
            if column not in row:  # the loader's check_columns, on the first row: same line
                raise ConfigError(f"{where}.column_map.{field}",
                                  f"the dataset has no column {column!r} (columns: {', '.join(map(str, row))})")
            renamed[field] = row[column]
        try:
            row_tools(renamed)
        except ValueError as exc:
            raise ConfigError(where, f"the first row of {dataset.path}: {exc}") from None
        fields = ", ".join(map(repr, row)) or "no fields"
        try:
            item = fmt.descriptor.transform(renamed)
        except KeyError as exc:  # a field the format reads is not there: another format, or columns named otherwise
            shown = f"missing field {exc.args[0]!r}" if exc.args else "a missing field"
            raise ConfigError(f"{where}.format",
                              f"'{dataset.format}' cannot read the first row of {dataset.path} ({shown}; the row "
                              f"has {fields}); choose the format that matches the data, or map its columns with "
                              "column_map") from None
        except (ValueError, TypeError) as exc:  # the fields are there, a value is not what the format reads
            raise ConfigError(f"{where}.format",
                              f"'{dataset.format}' cannot read the first row of {dataset.path} ({exc}; the row has "
                              f"{fields}); fix the row, or choose the format that matches the data") from None
        if chats is None and _messages_in(item):
            chats = where
    return chats


def _messages_in(item: Any) -> bool:
    """Whether a format's item holds chat messages (``{"role": ...}`` objects), at any depth of its lists and
    dataclass fields: what a chat template renders. A plain string (text or completion rows) is none."""
    from dataclasses import fields, is_dataclass

    if isinstance(item, Mapping):
        return "role" in item
    if isinstance(item, (list, tuple)):
        return any(_messages_in(value) for value in item)
    if is_dataclass(item) and not isinstance(item, type):
        return any(_messages_in(getattr(item, f.name)) for f in fields(item))
    return False


def first_csv_row(path: Path, where: str) -> dict[str, str] | None:
    """A ``.csv`` file's first row under its header, every cell text as the loader reads it (an empty cell is "");
    None for other files, or one the csv module cannot read (the loader says why)."""
    if path.suffix != ".csv" or not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            row = next(csv.DictReader(handle), None)
    except (csv.Error, UnicodeDecodeError, OSError):
        return None
    if row is None:
        raise ConfigError(where, f"{path}: the file has no rows under its header")
    return {key: value for key, value in row.items() if key is not None}


def first_parquet_row(path: Path, where: str) -> dict[str, Any] | None:
    """A ``.parquet`` file's first row, read alone (pyarrow, which `datasets` reads it with); None for other
    files, or one pyarrow cannot read (the loader says why)."""
    if path.suffix != ".parquet" or not path.is_file():
        return None
    try:
        import pyarrow.parquet

        batch = next(pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=1), None)
    except Exception:  # noqa: BLE001 - not a Parquet file pyarrow reads: the loader's message is the one to give
        return None
    if batch is None or batch.num_rows == 0:
        raise ConfigError(where, f"{path}: the file has no rows")
    return batch.to_pylist()[0]


def first_jsonl_row(path: Path | str, where: str, *, strict: bool = True) -> dict[str, Any] | None:
    """The first non-empty line of a ``.jsonl`` file as a mapping; None for other file types and
    folders (the loader checks those). A file with no row is refused; so, when ``strict``, is a first
    line that is not UTF-8 or not a JSON object, with the messages the loader gives."""
    path = Path(path)
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                problem: str | None = "not UTF-8 text; save the file as UTF-8"
            else:
                problem = line_problem(line)
            if problem is None:
                return json.loads(line.removeprefix(BOM))
            if strict:
                raise ConfigError(where, f"{path}: line {number}: {problem}")
            return None
    raise ConfigError(where, f"{path}: the file is empty (no rows)")


#: the mark some editors (Windows') put before a UTF-8 file's first line: `datasets` reads past it, and so do the checks
BOM = "\ufeff"


def line_problem(line: str) -> str | None:
    """Why one line of a JSON Lines file is not a row, or None (blank lines are skipped, as `datasets` does)."""
    line = line.removeprefix(BOM)
    if not line.strip():
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:  # a row nested thousands of levels deep (Arrow's reader may crash on it too)
        return "nested too deeply to read (thousands of levels)"
    return None if isinstance(value, dict) else f"expected a JSON object (one row), got {json_kind(value)}"


def json_kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(type(value), "a number")
