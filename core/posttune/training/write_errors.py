"""A failed write (disk full, permission denied, a path under a file) is a user error, in one line.

Checkpoints and the final model are written through ``atomic_dir``: on any error the
temporary directory goes and the previous version stays as it was. What remains is to say
what happened in one line that names the path and the reason, instead of a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from posttune.errors import PosttuneError

#: torch.save reports a failed write of its zip container as a RuntimeError, not an OSError
TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "file write failed", "inline_container", "unexpected pos")


class WriteError(PosttuneError):
    """Writing a checkpoint, the final model or the metrics failed; what was there before is intact."""


@contextlib.contextmanager
def writing(target: str | Path, what: str) -> Iterator[None]:
    """Turn a failed write under ``target`` into a one-line ``WriteError`` naming it, the file, the
    reason and the free space; anything else passes through."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        reason = _reason(exc, Path(target))
        if reason is None:
            raise
        raise WriteError(f"cannot write {what} {target}{reason}; {free_space(target)}; {_intact(what)}") from None


def _reason(exc: BaseException, target: Path) -> str | None:
    """`` (file): why`` for a failed write, or None for any other error."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint: rank -> (error, traceback)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return _reason(first[0] if isinstance(first, tuple) else first, target)
    if isinstance(exc, OSError):
        why = exc.strerror or errno.errorcode.get(exc.errno or 0, "") or str(exc)
        file = f" ({Path(exc.filename).name})" if exc.filename and Path(exc.filename) != target else ""
        return f"{file}: {why}"
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in TORCH_WRITE_FAILED):
        return ": the write failed"
    return None


def torch_write_failed(exc: BaseException, path: Path) -> OSError:
    """torch.save's failed write (disk full, a file size limit) as an OSError naming the file.

    torch reports it as a RuntimeError from its zip writer ("[enforce fail at inline_container.cc:...]
    unexpected pos ..."), with neither the file nor the cause; the message's last part is kept.
    """
    detail = str(exc).splitlines()[0].rsplit("] ", 1)[-1].strip(" .") if str(exc) else type(exc).__name__
    return OSError(errno.EIO, f"the write stopped short ({detail}){_size_limit()}", str(path))


def _size_limit() -> str:
    """The process's file size limit, when one is set: a write cut short by it looks like a full disk."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return ""
    return "" if limit == resource.RLIM_INFINITY else f"; the process's file size limit (ulimit -f) is {limit} bytes"


def free_space(target: str | Path) -> str:
    """How much room the disk under ``target`` has left, as the one-line error says it."""
    existing = Path(target).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return "free space unknown"
    size = next((f"{free / 2 ** (10 * i):.1f} {unit}" for i, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB"))
                 if free >= 2 ** (10 * i)), f"{free} bytes")
    return f"{size} free on its disk"


def _intact(what: str) -> str:
    return {"checkpoint": "the previous checkpoints are intact",
            "model": "any previous final model there is intact"}.get(what, "nothing else was changed")
