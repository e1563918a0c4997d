"""The output directory belongs to one run, and to one lineage of runs (docs/training.md).

A run (or a chain of resumed runs: a *lineage*) owns ``checkpoint.output_dir``:

- while it trains it holds ``.posttune.lock`` (``run_lock.py``), so a second run on the same
  directory is refused instead of interleaving ``metrics.jsonl`` and pruning the first one's
  checkpoints;
- a new run refuses a directory that holds another run's results unless it resumes
  (``checkpoint.resume``) or is told to start afresh (``checkpoint.overwrite: true``);
- ``run.json`` names the lineage (its run id), which each checkpoint also records, so
  pruning and ``resume: latest`` only ever consider checkpoints of this lineage;
- ``run.json`` is also the mark of a run's own directory: an output directory must be new, empty
  or marked, and never the filesystem root, the home directory, or a path that resolves inside
  another run's directory (through ``..`` or a symlink), so a run never writes over the user's
  files or nests in (and prunes) another run.

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

from posttune.errors import ConfigError, PosttuneError, did_you_mean
from posttune.training import run_lock
from posttune.training.write_errors import writing

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
#: ``checkpoint.resume``'s one word: the newest intact checkpoint of the lineage
LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
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
    check_ownable(config)
    check_writable(out)
    if lock and (who := run_lock.holder(out)) is not None:
        raise run_lock.in_use(out, who)
    check_results(config)


#: what a directory may hold before its first run writes ``run.json``: the lock, probes, leftovers
UNMARKED_OK = re.compile(r"^(\.posttune\.lock|\.posttune-probe-.*|\..+\.(tmp|old)-[0-9a-f]{8})$")


def check_ownable(config: Any) -> None:
    """Refuse a directory the run could not call its own: the filesystem root, the home directory,
    a folder of other files (the user's ``config.yaml`` among them), a path inside another run's
    directory, or a symlink to another run that ``overwrite`` would empty."""
    out = output_path(config)
    real = out.resolve()

    def refuse(why: str) -> ConfigError:
        return ConfigError("checkpoint.output_dir", f"{out} {why}")

    if real == Path(real.anchor) or real == Path.home().resolve():
        raise refuse(f"is {'the filesystem root' if real == Path(real.anchor) else 'your home directory'}; "
                     "name a folder of its own for the run, e.g. outputs/my-run")
    _refuse_inside_data(config, real, refuse)
    for parent in real.parents:
        if (parent / RUN_FILE).is_file():
            raise refuse(f"resolves to {real}, inside the output directory of another run ({parent}); choose a "
                         "folder outside it")
    if not real.is_dir():
        return
    if (real / RUN_FILE).is_file():
        if out.is_symlink() and config.checkpoint.overwrite and config.checkpoint.resume is None:
            raise refuse(f"is a symlink to {real}, another run's output directory, and checkpoint.overwrite "
                         f"would remove its results; name {real} itself to start afresh there")
        return
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in real.iterdir() if not UNMARKED_OK.match(p.name))
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise refuse(f"holds files that are not a posttune run's ({shown}; no {RUN_FILE}); an output directory "
                     "must be new, empty, or a run's own: choose another")


def _refuse_inside_data(config: Any, real: Path, refuse: Any) -> None:
    """A folder of data files is read whole: a run's files inside it would be read as rows (and break every later
    run on that folder)."""
    from posttune.config.mixture import dataset_sources

    data = getattr(config, "data", None)
    sections = [(f"data.{split}", getattr(data, split, None)) for split in ("train", "validation")]
    for at, source in (pair for where, dataset in sections if dataset is not None
                       for pair in dataset_sources(dataset, where)):
        folder = Path(str(source.path)).expanduser().resolve() if getattr(source, "path", None) else None
        if folder is not None and folder.is_dir() and (real == folder or folder in real.parents):
            raise refuse(f"is inside {at}.path ({folder}), a folder read whole as data: the run's own files would "
                         "be read as rows; choose a folder outside it")


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
    if found and checkpoint.resume == LATEST and not checkpoint.overwrite \
            and json_field(out / RUN_FILE, "status") == "finished" \
            and not checkpoints(out / CHECKPOINTS):  # `latest` would start at step 0 over the finished results
        raise ConfigError("checkpoint.resume", f"latest: {out} holds a finished run with no checkpoint to continue "
                                               "from (checkpoint.save_every was unset, or keep_last pruned them all): "
                                               "restart it with checkpoint.overwrite=true, or train into another "
                                               "output_dir from its model")


def json_field(path: Path, key: str) -> Any:
    """``key`` of the JSON object in ``path``; None when it is absent, or the file missing or unreadable."""
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


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
    check_ownable(config)
    check_writable(out)
    with writing(out, "output directory"):
        fd = run_lock.acquire(out)
    try:
        check_ownable(config)  # again under the lock: the folder may have changed since
        check_results(config)
        with writing(out, "output directory"):
            clean_leftovers(out)
            if config.checkpoint.overwrite and config.checkpoint.resume is None:
                clear_results(out, unwritten(config))
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


def unwritten(config: Any) -> tuple[str, ...]:
    """The final-output folders this run will not write (``model`` for an adapter run that saves no merged model,
    ``adapter`` for full fine-tuning): an overwritten run's copy would otherwise stay, as if this run's."""
    if config.adapter is None:
        return ("adapter",)
    return () if config.checkpoint.save_merged else ("model",)


def clear_results(out: Path, also: tuple[str, ...] = ()) -> None:
    """``checkpoint.overwrite``: each old result is renamed aside first, so a crash midway leaves a
    leftover that the next start removes, never a half-deleted checkpoint directory. ``also``: old outputs
    this run will not replace (the rest stay until the final save replaces them)."""
    found = [name for name in (*CLEARED, *also) if (out / name).exists()]
    if found:
        print(f"posttune: checkpoint.overwrite: removing the previous run's {', '.join(found)} from {out}")
    for name in found:
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
    """Write ``run.json`` (replacing it whole, never torn): the lineage a later ``resume: latest`` follows, and
    what an operator asks of a run's folder: its status (``record_status`` ends it), where and how it ran."""
    import platform
    import sys

    from posttune.version import __version__

    record = {"run_id": run_id, "resumed_from": str(resumed_from) if resumed_from else None, "started": time.time(),
              "status": "running", "host": platform.node(), "pid": os.getpid(), "cwd": os.getcwd(),
              "argv": sys.argv, "posttune": __version__}
    _write_run(out, record)


def record_status(out: Path, status: str, **details: Any) -> None:
    """``run.json``'s ``status`` as the run ends (finished, preempted, failed, interrupted), with ``details``;
    a folder without one (the run never got that far) is left alone."""
    try:
        record = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return
    with contextlib.suppress(PosttuneError, OSError):  # never in the way of the error that ends the run
        _write_run(out, {**record, "status": status, "ended": time.time(), **details})


def record_job_failure(out: Path, error: str, pids: set[int]) -> None:
    """A torchrun job's failure as its launcher reports it, over whatever rank 0 recorded: torchrun stops the healthy
    ranks with SIGTERM when one fails, so rank 0 may have written "preempted" (or its collective's lost peer). Only
    a record one of the job's ranks wrote (its ``pid``) is touched: a folder another run holds stays as it is."""
    try:
        record = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return
    if record.get("pid") in pids and record.get("status") != "finished":
        record_status(out, "failed", error=error)


def _write_run(out: Path, record: dict[str, Any]) -> None:
    tmp = out / f".{RUN_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    with writing(out / RUN_FILE, "run record"):
        out.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, out / RUN_FILE)
        finally:  # a write that failed (a full disk) leaves no half file behind: its error says nothing changed
            tmp.unlink(missing_ok=True)


# ---- the checkpoints of a lineage ---------------------------------------------------------------

def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temp dirs of a killed save are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def run_id_of(checkpoint: Path) -> str | None:
    """The lineage a checkpoint belongs to: its run id, ``""`` for one written before run ids
    existed (it belongs to any lineage), None when its trainer state is unreadable."""
    try:
        return str(json.loads((checkpoint / STATE_FILE).read_text()).get("run_id") or "")
    except (OSError, ValueError, AttributeError):
        return None


def lineage(root: Path, run_id: str | None, *, unreadable: bool = False) -> list[Path]:
    """The checkpoints of lineage ``run_id`` (None: of any), oldest first; ``unreadable``: with those whose trainer
    state cannot say (a resume names them as damaged rather than passing over them unsaid)."""
    ours = (run_id, "", None) if unreadable else (run_id, "")
    return [p for p in checkpoints(root) if run_id is None or run_id_of(p) in ours]


def prune(root: Path, keep_last: int | None, run_id: str | None = None, keep: Path | None = None) -> None:
    """Keep the newest ``keep_last`` checkpoints of lineage ``run_id`` (another run's are never
    touched) and ``keep`` (the best one); remove temp dirs that a killed save left behind."""
    for torn in root.glob(".step-*"):
        if LEFTOVER.match(torn.name):
            shutil.rmtree(torn, ignore_errors=True)
    if keep_last is None:
        return
    mine = lineage(root, run_id)
    for old in mine[:-keep_last] if keep_last > 0 else mine:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def resume_candidate(config: Any) -> Path | None:
    """The checkpoint ``checkpoint.resume`` points at, unverified (validate's view; train verifies it):
    the newest of the lineage for ``latest``, the path itself otherwise, None for a fresh run.
    Refuses what train would: a path that does not exist, and a checkpoint past ``train.max_steps``."""
    resume = config.checkpoint.resume
    if resume is None:
        return None
    if resume != LATEST:
        found = named_checkpoint(resume)
    else:
        out = output_path(config)
        mine = lineage(out / CHECKPOINTS, recorded_run_id(out))
        found = mine[-1] if mine else None
    check_resume_step(config, found)
    return found


def named_checkpoint(resume: str) -> Path:
    """The checkpoint directory ``checkpoint.resume`` names by path; one that does not exist is refused
    in one line (a near miss of ``latest``, e.g. ``last``, is most likely a typo, so the line says so)."""
    path = Path(resume).expanduser()
    if not path.exists():
        hint = did_you_mean(resume.lower(), [LATEST])
        raise ConfigError("checkpoint.resume", f"{resume} does not exist{hint}; name a checkpoint directory "
                                               f"(OUTPUT_DIR/checkpoints/step-N) or '{LATEST}'")
    if not path.is_dir():
        raise ConfigError("checkpoint.resume", f"{resume} is a file, not a checkpoint directory "
                                               "(OUTPUT_DIR/checkpoints/step-N)")
    return path


def saved_step(checkpoint: Path) -> int | None:
    """The step ``checkpoint`` recorded in its trainer state, None when that is unreadable."""
    step = json_field(checkpoint / STATE_FILE, "step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def check_resume_step(config: Any, checkpoint: Path | None, total: int | None = None) -> None:
    """Refuse to resume a checkpoint past the run's last step: such a run trains nothing, yet would
    overwrite config.yaml and the final model with a run that claims fewer steps than it holds.
    The last step is ``train.max_steps``, or ``total`` (the steps of ``train.epochs``) once known;
    a checkpoint at exactly that step resumes (nothing left to train: it finishes the run)."""
    step = saved_step(checkpoint) if checkpoint is not None else None
    max_steps = config.train.max_steps
    last = max_steps if max_steps is not None else total
    if step is None or last is None or step <= last:
        return
    where = f"the checkpoint to resume ({checkpoint}) is at step {step}"
    start_afresh = ("or start afresh without checkpoint.resume, with checkpoint.overwrite=true (or another "
                    "checkpoint.output_dir)")
    if max_steps is not None:
        raise ConfigError("train.max_steps", f"{max_steps} is below the step already trained: {where}; set "
                                             f"train.max_steps to {step} or more to continue that run, {start_afresh}")
    raise ConfigError("train.epochs", f"{config.train.epochs} epoch(s) make {last} steps, fewer than already trained: "
                                      f"{where}; raise train.epochs (or set train.max_steps to {step} or more) to "
                                      f"continue that run, {start_afresh}")
