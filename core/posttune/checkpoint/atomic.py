"""Write a directory so that a crash never leaves a half-written one at the target.

See docs/architecture.md, "Checkpoints and resume".

Everything is written into a hidden temporary directory next to the target (same file
system, so a rename moves it), each file fsynced; then the temporary directory is renamed
into place and the parent directory fsynced. A previous directory at the target is first
renamed aside and removed only once the new one is in place: a crash between the two
renames leaves it intact as ``.NAME.old-*`` next to the target.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from posttune.errors import PosttuneError


@contextlib.contextmanager
def atomic_dir(target: str | Path, *, replaceable: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary directory; on a clean exit it becomes ``target``.

    An existing ``target`` is replaced only if it is empty or holds one of ``replaceable``
    (e.g. ``config.json``): saving over an unrelated folder must not delete it. On any
    error the temporary directory is removed and ``target`` is left as it was.
    """
    target = Path(target).expanduser().absolute()
    _check_replaceable(target, replaceable)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_replaceable(target: Path, replaceable: tuple[str, ...]) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise PosttuneError(f"{target}: exists and is not a directory")
    if any(target.iterdir()) and not any((target / name).exists() for name in replaceable):
        raise PosttuneError(f"{target}: refusing to replace a non-empty directory that is not a "
                            f"checkpoint (no {' or '.join(replaceable) or 'known file'}); "
                            f"choose an empty or new directory")


def _swap_into_place(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    _fsync_entry(target.parent)  # the renames; the files were flushed before (not the parent's other files)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk (files written by other libraries, e.g. tokenizers)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush every file under ``path`` and the directory entries themselves."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fsync_file(Path(root) / name)
        _fsync_entry(Path(root))
        for name in dirs:
            _fsync_entry(Path(root) / name)


def _fsync_entry(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse fsync on directories
        fsync_file(directory)
