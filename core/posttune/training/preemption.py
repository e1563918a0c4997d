"""Preemption: SIGTERM finishes the current step, saves a checkpoint there and exits with 143; during
the final save it lets the save finish (the run is then complete, and exits 0).

SLURM and Kubernetes send SIGTERM some time before they kill a job. The handler only sets a
flag; the trainer looks at it after each optimizer step, so the step in flight completes and
the checkpoint holds a consistent state. Under torchrun every rank must stop at the same step
(a checkpoint is collective), so the flag is all-reduced each step: one integer. A second
SIGTERM exits at once; one that arrives within ``DUPLICATE_S`` of the first is taken for the
same request delivered twice (SLURM signals every process of a step and torchrun forwards
its own signal to the workers too).

A torchrun worker whose launcher dies outright (SIGKILL, the OOM killer) is reparented and
would train on unsupervised to the end; a watcher thread notices the parent pid change within
``PARENT_POLL_S`` and asks for the same stop: checkpoint at the current step, exit 143.
docs/training.md, "Preemption".
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the exit status of a preempted run: 128 + SIGTERM, what a shell reports for a job ended by it
PREEMPTED = 128 + signal.SIGTERM
DUPLICATE_S = 2.0

PARENT_POLL_S = 1.0

_requested_at: float | None = None
_why = "SIGTERM"


class Preempted(Exception):  # noqa: N818 - not an error: the run stopped as asked
    """The run stopped on SIGTERM (or its launcher's death) after writing ``checkpoint`` at ``step``."""

    def __init__(self, step: int, checkpoint: Path):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"preempted by {_why}: saved checkpoint {checkpoint} at step {step}; resume with "
                         "checkpoint.resume=latest")


class StoppedInSetup(Exception):  # noqa: N818 - not an error: the run stopped as asked
    """SIGTERM while the run was being prepared (weights loading, data tokenizing): no step ran, nothing to save."""

    def __init__(self) -> None:
        super().__init__("SIGTERM while the run was being prepared: no step ran, so no checkpoint was written; "
                         "start it again (a resumed run resumes from the same checkpoint)")


@contextlib.contextmanager
def stopping_setup() -> Iterator[None]:
    """SIGTERM during setup ends it at once, as an exception the run records (its default would kill the process
    with run.json still saying "running"). Main thread only, like ``watching``."""
    def stop(signum: int, _frame: Any) -> None:
        raise StoppedInSetup()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Catch SIGTERM for the duration of the loop (main thread only; elsewhere nothing changes)."""
    global _requested_at, _why
    _requested_at, _why = None, "SIGTERM"
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals to whoever owns them
        yield
        return
    done = threading.Event()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its launcher may die without a word
        threading.Thread(target=_watch_parent, args=(os.getppid(), done), name="posttune-parent-watch",
                         daemon=True).start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGTERM, previous)
        _requested_at = None


def _watch_parent(parent: int, done: threading.Event) -> None:
    """Ask for a stop once this process has a new parent: the launcher that started it is gone."""
    global _requested_at, _why
    while not done.wait(PARENT_POLL_S):
        if os.getppid() != parent:
            _why = f"the death of its launcher (pid {parent})"
            if _requested_at is None:
                _requested_at = time.monotonic()
            print(f"posttune: the launcher (pid {parent}) is gone: stopping at the end of this step, with a "
                  "checkpoint", file=sys.stderr, flush=True)
            return


def _on_sigterm(signum: int, _frame: Any) -> None:
    global _requested_at
    now = time.monotonic()
    if _requested_at is None:
        _requested_at = now
    elif now - _requested_at > DUPLICATE_S:  # asked twice: stop now, without the checkpoint
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def asked() -> bool:
    """Whether this process was asked to stop (no collective): the final save, which every rank runs to its end
    (``watching`` around it), needs no agreement on when to stop."""
    return _requested_at is not None


def requested(device: Any = None) -> bool:
    """Whether any rank was asked to stop; collective under torch.distributed (every rank calls it)."""
    from posttune.training import distributed

    asked = _requested_at is not None
    if not distributed.active():
        return asked
    import torch

    flag = torch.tensor([1.0 if asked else 0.0], device=device)
    return bool(distributed.all_reduce_max(flag).item())
