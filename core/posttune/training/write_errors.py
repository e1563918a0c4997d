"""A failed write (disk full, permission denied, a path under a file) is a user error, in one line.

Checkpoints and the final model are written through ``atomic_dir``: on any error the
temporary directory goes and the previous version stays as it was. What remains is to say
what happened in one line that names the path and the reason, instead of a traceback.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path

from posttune.errors import PosttuneError

#: torch.save reports a failed write of its zip container as a RuntimeError, not an OSError
TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "file write failed")


class WriteError(PosttuneError):
    """Writing a checkpoint, the final model or the metrics failed; what was there before is intact."""


@contextlib.contextmanager
def writing(target: str | Path, what: str) -> Iterator[None]:
    """Turn a failed write under ``target`` into a one-line ``WriteError`` naming it and the reason."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, "") or str(exc)
        file = f" ({Path(exc.filename).name})" if exc.filename and Path(exc.filename) != Path(target) else ""
        raise WriteError(f"cannot write {what} {target}{file}: {reason}; {_intact(what)}") from None
    except RuntimeError as exc:
        if not any(marker in str(exc) for marker in TORCH_WRITE_FAILED):
            raise
        raise WriteError(f"cannot write {what} {target}: the write failed (disk full?); {_intact(what)}") from None


def _intact(what: str) -> str:
    return {"checkpoint": "the previous checkpoints are intact",
            "model": "a previous final model there is intact"}.get(what, "nothing else was changed")
