"""Dataset rows from a config: local json/jsonl/parquet/csv/txt files or folders, or a hub dataset.

Everything goes through `datasets.load_dataset`, so local files and hub datasets behave the same
(Arrow-backed map-style datasets, or `IterableDataset` with ``streaming: true``); a folder written by
``save_to_disk`` through `datasets.load_from_disk` (a `DatasetDict`'s ``split`` chosen by name). A path that does
not exist and does not look like a hub name is reported as a missing file, naming the config field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttune import hub
from posttune.config.data_checks import local_files, local_path, local_split, saved_by_datasets
from posttune.config.schema import DatasetConfig
from posttune.data.local_files import check_files, cleaned, explain_failure, scratch_cache
from posttune.errors import ConfigError, PosttuneError, first_line


def load_rows(config: DatasetConfig, *, where: str = "data.train", skip_bad_rows: bool = False,
              skipped: Any = None) -> Any:
    """The rows of one dataset: a `datasets.Dataset`, or an `IterableDataset` when streaming.

    Local files are checked first (``local_files.check_files``): with ``skip_bad_rows`` the
    unreadable lines of line-based files are dropped and added to ``skipped.bad_rows``.
    """
    path = local_path(config, where)
    if path is not None and saved_by_datasets(path):
        return _from_disk(config, path, where)
    if path is not None:
        builder, files = local_files(path, where)
        files, dropped, first = check_files(files, builder, where, skip_bad_rows=skip_bad_rows)
        if dropped and skipped is not None:
            skipped.bad_rows += dropped
            skipped.first_bad = skipped.first_bad or f"{where}: {first}"
        split = local_split(config.split, where)
        def explain() -> str | None:
            return explain_failure(files, builder)

        rows = _load(where, str(path), builder, data_files=files, split=split, streaming=config.streaming,
                     explain=explain, **(_as_text(files) if builder == "csv" else {}),
                     **({"cache_dir": scratch_cache()} if cleaned(files) else {}))
        if config.streaming:  # a bad line is met mid-run: `guarded` names its file and line through this
            rows.posttune_explain = explain
            if builder == "json":  # and datasets' own line then ("Invalid encoding ... in row 175") misleads
                import logging

                logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
        return rows
    if not hub.offline_requested(datasets=True) and not hub.reachable():  # else retries for half a minute
        raise hub.unreachable(config.path, f"config: {where}.path", local="a local file or folder", cache_tried=False)
    return _load(where, config.path, config.path, name=config.subset, split=config.split,
                 streaming=config.streaming, hint="; no local file or directory has that name either")


def _as_text(files: list[str]) -> dict[str, Any]:
    """CSV cells read as written: pandas would make "None", "N/A" and "nan" nulls and "007" the number 7.0, so a
    row's text turned into a missing field or a float. Every column is a string (the header names them)."""
    import csv

    import datasets

    with open(files[0], encoding="utf-8-sig", newline="") as handle:
        columns = next(csv.reader(handle), [])
    return {"keep_default_na": False, "encoding": "utf-8-sig",  # a BOM is no part of the first column's name
            "features": datasets.Features({name: datasets.Value("string") for name in columns})}


def _from_disk(config: DatasetConfig, path: Path, where: str) -> Any:
    """A ``save_to_disk`` folder's rows: a Dataset whole (a slice, ``train[:50%]``, as ``split`` says), or one
    split of a DatasetDict."""
    import datasets

    try:
        rows = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ConfigError(f"{where}.path", f"could not load {str(path)!r}, a folder of datasets' save_to_disk "
                                           f"({type(exc).__name__}: {first_line(str(exc))})") from None
    name, bracket, _ = config.split.partition("[")
    if isinstance(rows, datasets.DatasetDict):
        if name not in rows:
            raise ConfigError(f"{where}.split", f"{str(path)!r} holds the splits {', '.join(rows)}, not {name!r}")
        rows = rows[name]
    elif name != "train":
        raise ConfigError(f"{where}.split", f"{config.split!r}: {str(path)!r} holds one dataset, read as the split "
                                            "'train' (slices such as train[:90%] work)")
    if bracket:  # a slice, read as datasets reads one of a split
        rows = rows.select(range(len(rows))[_slice(config.split, len(rows), where)])
    return rows.to_iterable_dataset() if config.streaming else rows


def _slice(split: str, size: int, where: str) -> slice:
    import datasets

    try:
        instruction = datasets.ReadInstruction.from_spec(split).to_absolute({split.partition("[")[0]: size})[0]
    except Exception as exc:
        raise ConfigError(f"{where}.split", f"{split!r}: {first_line(str(exc))}") from None
    return slice(instruction.from_, instruction.to)


def _in_cache(filename: Any) -> bool:
    """Whether an OS error's file is datasets' cache (where it writes Arrow files of what it reads), lies in it, or
    is a folder on the way to it (HF_HOME under a file)."""
    import datasets

    if filename is None:
        return False
    cache, file = Path(datasets.config.HF_DATASETS_CACHE).expanduser().absolute(), Path(str(filename)).absolute()
    return file == cache or cache in file.parents or file in cache.parents


def _load(where: str, shown: str, path: str, *, hint: str = "", explain: Any = None, **kwargs: Any) -> Any:
    import datasets

    quiet = Path(path).exists() or path in ("json", "csv", "parquet", "text")  # local: nothing to watch
    if quiet:
        datasets.disable_progress_bars()
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its "Failed to load JSON" line: ours says more
    try:
        return datasets.load_dataset(path, **kwargs)
    except Exception as exc:  # unreadable file, offline hub, unknown split: one line naming the dataset
        found = explain() if explain is not None else None
        if found is not None:
            raise ConfigError(f"{where}.path", found) from None
        cause = exc
        while cause.__cause__ is not None:  # datasets wraps the reason ("An error occurred while generating ...")
            cause = cause.__cause__
        mismatch = exc  # the column mismatch is wrapped as the cause, or (datasets before 4.7) only as the context
        while mismatch is not None and getattr(mismatch, "table_column_names", None) is None:
            mismatch = mismatch.__cause__ or mismatch.__context__
        theirs = getattr(mismatch, "table_column_names", None)
        wanted = getattr(mismatch, "requested_column_names", None)
        if theirs is not None and wanted is not None:  # files of one folder or list with other columns
            raise ConfigError(f"{where}.path", f"the files of {shown!r} do not share their columns "
                                               f"({', '.join(wanted)} in one, {', '.join(theirs)} in another): they "
                                               "are read as one table; give them the same columns, or list each "
                                               "as its own dataset (a mixture)") from None
        problem = first_line(str(cause)) or type(cause).__name__
        if isinstance(cause, OSError) and _in_cache(cause.filename):  # the data is fine: its cache is not
            raise PosttuneError(f"{where}: datasets' cache cannot be written ({type(cause).__name__}: {problem}): "
                                f"HF_DATASETS_CACHE (or HF_HOME, XDG_CACHE_HOME) must name a writable "
                                f"folder") from None
        problem = f"could not load {shown!r} ({type(cause).__name__}: {problem}){hint}"
        raise ConfigError(f"{where}.path", problem) from None
    finally:
        if quiet:
            datasets.enable_progress_bars()
            datasets.logging.set_verbosity(verbosity)


def check_columns(rows: Any, column_map: Mapping[str, str], where: str) -> None:
    """Refuse a ``column_map`` naming a column the dataset lacks (when the columns are known up front)."""
    columns = getattr(rows, "column_names", None)
    if not columns:
        return
    for field, column in column_map.items():
        if column not in columns:
            raise ConfigError(f"{where}.column_map.{field}",
                              f"the dataset has no column {column!r} (columns: {', '.join(columns)})")


def rename(row: Mapping[str, Any], column_map: Mapping[str, str]) -> Mapping[str, Any]:
    """A row with each mapped dataset column also available under the format's field name."""
    if not column_map:
        return row
    renamed = dict(row)
    for field, column in column_map.items():
        renamed[field] = row.get(column)
    return renamed
