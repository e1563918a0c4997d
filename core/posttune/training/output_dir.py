"""The output directory belongs to one run, and to one lineage of runs (docs/training.md).

A run (or a chain of resumed runs: a *lineage*) owns ``checkpoint.output_dir``:

- while it trains it holds ``.posttune.lock`` (``run_lock.py``), so a second run on the same
  directory is refused instead of interleaving ``metrics.jsonl`` and pruning the first one's
  checkpoints;
- a new run refuses a directory that holds another run's results unless it resumes
  (``checkpoint.resume``) or is told to start afresh (``checkpoint.overwrite: true``);
- ``run.json`` names the lineage (its run id), which each checkpoint also records, so
  pruning and ``resume: latest`` only ever consider checkpoints of this lineage.

Everything here is torch-free: ``posttune validate`` runs the same checks as ``train``
("nothing validate accepts fails later for a reason it could have seen").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttune.errors import ConfigError
from posttune.training import run_lock
from posttune.training.write_errors import writing

RUN_FILE = "run.json"
METRICS = "metrics.jsonl"
#: what a finished or interrupted run leaves that a new run must not silently replace
RESULTS = ("checkpoints", "model", "adapter", METRICS)
#: what ``checkpoint.overwrite: true`` clears at the start (model/ and adapter/ stay until replaced)
CLEARED = ("checkpoints", METRICS, "loss.png", "summary.json")
#: temporary directories of atomic_dir: ``.NAME.tmp-XXXXXXXX`` and ``.NAME.old-XXXXXXXX``
LEFTOVER = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{8}$")


def output_path(config: Any) -> Path:
    return Path(config.checkpoint.output_dir).expanduser()


def check_output_dir(config: Any, *, lock: bool = True) -> None:
    """Refuse, in one line, an output directory this run could not own: not writable, a path
    under a file, held by a live run (``lock``), or holding another run's results."""
    out = output_path(config)
    check_writable(out)
    if lock and (who := run_lock.holder(out)) is not None:
        raise run_lock.in_use(out, who)
    check_results(config)


def check_writable(out: Path) -> None:
    """The directory, or its nearest existing parent, takes a new file; nothing is left behind."""
    existing = out.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("checkpoint.output_dir", f"{existing} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".posttune-probe-", dir=existing)
    except OSError as exc:
        raise ConfigError("checkpoint.output_dir", f"cannot write in {existing}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def check_results(config: Any) -> None:
    out, checkpoint = output_path(config), config.checkpoint
    found = results(out)
    if found and checkpoint.resume is None and not checkpoint.overwrite:
        raise ConfigError("checkpoint.output_dir", f"{out} holds another run's results ({', '.join(found)}); set "
                                                   "checkpoint.resume=latest to continue that run, "
                                                   "checkpoint.overwrite=true to start afresh, or choose another "
                                                   "output_dir")


def results(out: Path) -> list[str]:
    """The names of the results a previous run left in ``out`` (empty ones do not count)."""
    found = []
    for name in RESULTS:
        path = out / name
        if path.is_dir() and any(not p.name.startswith(".") for p in path.iterdir()):
            found.append(f"{name}/")
        elif path.is_file() and path.stat().st_size > 0:
            found.append(name)
    return found


@contextlib.contextmanager
def claimed(config: Any, *, main: bool) -> Iterator[None]:
    """Hold the output directory for the run (rank 0; other ranks only follow).

    Under the lock the results check runs again (another run may have finished since
    validation), the temporary directories a killed run left are removed, and with
    ``checkpoint.overwrite`` (and no resume) the previous run's checkpoints and metrics go.
    """
    if not main:
        yield
        return
    out = output_path(config)
    check_writable(out)
    with writing(out, "output directory"):
        fd = run_lock.acquire(out)
    try:
        check_results(config)
        with writing(out, "output directory"):
            clean_leftovers(out)
            if config.checkpoint.overwrite and config.checkpoint.resume is None:
                clear_results(out)
        yield
    finally:
        run_lock.release(fd)


def clean_leftovers(out: Path) -> None:
    """Remove what an interrupted atomic write left: ``.step-*.tmp-*``, ``.model.tmp-*``, ``.*.old-*``."""
    for directory in (out, out / "checkpoints"):
        if directory.is_dir():
            for path in directory.iterdir():
                if LEFTOVER.match(path.name):
                    _remove(path)


def clear_results(out: Path) -> None:
    """``checkpoint.overwrite``: each old result is renamed aside first, so a crash midway leaves a
    leftover that the next start removes, never a half-deleted checkpoint directory."""
    for name in CLEARED:
        path = out / name
        if path.exists():
            aside = out / f".{name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, aside)
            _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# ---- the lineage ------------------------------------------------------------------------------

def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def recorded_run_id(out: Path) -> str | None:
    """The lineage the last run in ``out`` belonged to (``run.json``), or None."""
    try:
        return str(json.loads((out / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_run(out: Path, run_id: str, resumed_from: Path | None) -> None:
    """Write ``run.json`` (replacing it whole, never torn): the lineage a later ``resume: latest`` follows."""
    record = {"run_id": run_id, "resumed_from": str(resumed_from) if resumed_from else None, "started": time.time()}
    tmp = out / f".{RUN_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    with writing(out / RUN_FILE, "run record"):
        out.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, out / RUN_FILE)
