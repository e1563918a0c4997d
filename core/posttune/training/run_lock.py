"""One run per output directory: an advisory lock held for the whole run (docs/training.md).

``OUTPUT_DIR/.posttune.lock`` is locked with ``flock`` by the process that trains (rank 0
under torchrun) and holds its host and pid. The kernel releases the lock when that process
ends, however it ends, so a lock left by a dead run is simply taken over: there is nothing
stale to clean up by hand. Torch-free, so ``posttune validate`` can ask who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from posttune.errors import RETRY, ConfigError

LOCK_FILE = ".posttune.lock"


def holder(output_dir: str | Path) -> str | None:
    """``host H, pid P`` of the run that holds the lock now, or None when nobody does."""
    path = Path(output_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (or unreadable): nobody we could name holds it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(path)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire(output_dir: str | Path) -> int:
    """Lock ``output_dir`` for this process; the returned descriptor must stay open for the run.

    Refuses in one line, naming the holder, when another live run has it.
    """
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise in_use(directory, _describe(path)) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode())
    return fd


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def in_use(directory: Path, who: str) -> ConfigError:
    """Exits with ``RETRY``: a requeued job may start while the one it replaces is still exiting."""
    error = ConfigError("checkpoint.output_dir", f"{directory} is in use by another run ({who}); wait for it to "
                                                 "finish or choose another output_dir")
    error.exit_status = RETRY
    return error


def _describe(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"host {info['host']}, pid {info['pid']}"
    except (OSError, ValueError, KeyError, TypeError):  # locked a moment before its holder wrote it
        return f"lock {path}"
