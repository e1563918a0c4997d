"""The memory allocator a training process runs on: jemalloc when the machine has it (docs/training.md, "Memory").

A training step frees and allocates activations of a different size every step (rows of different
lengths); glibc's malloc keeps what is freed in a heap that fragments, so a run's resident memory
ratchets up step after step, and buffers it hands back are page-faulted and zeroed again. jemalloc
reuses them: measured on a CPU full-SFT run, 0.82x the peak RSS at 1.19x the tokens/s, and 0.73x
the peak of a LoRA run (docs/benchmarks.md, "Where a CPU step's memory goes").

An allocator can only be chosen before a process starts (``LD_PRELOAD``), so ``posttune train``
re-executes itself once, first thing, with the library preloaded; the ranks a torchrun launch
starts inherit it. ``POSTTUNE_ALLOCATOR``: ``auto`` (the default: jemalloc if the dynamic linker
finds ``libjemalloc``, else the system's malloc, silently), ``jemalloc`` (required: an error when
missing), ``system`` (never preload), or a path to an allocator library.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

from posttune.errors import PosttuneError

ENV = "POSTTUNE_ALLOCATOR"
#: set in the re-executed process's environment: the library preloaded (and a guard against a second exec)
PRELOADED = "POSTTUNE_ALLOCATOR_PRELOADED"


def preload(argv: list[str]) -> None:
    """Re-execute ``python argv`` with the chosen allocator preloaded; return when there is nothing to do."""
    library = chosen_library()
    if library is None or PRELOADED in os.environ or _mapped(library):
        return
    preloads = [library, *filter(None, os.environ.get("LD_PRELOAD", "").split(":"))]
    env = {**os.environ, "LD_PRELOAD": ":".join(preloads), PRELOADED: library}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv], env)
    except OSError as exc:  # the run goes on with the system's allocator
        print(f"posttune: warning: could not restart with {library} preloaded ({exc}); {ENV}=system "
              "silences this", file=sys.stderr)


def chosen_library() -> str | None:
    """The library ``POSTTUNE_ALLOCATOR`` asks for (None: the system's malloc)."""
    choice = os.environ.get(ENV, "auto").strip() or "auto"
    if choice == "system" or not sys.platform.startswith("linux"):
        return None
    if choice in ("auto", "jemalloc"):
        found = ctypes.util.find_library("jemalloc")
        if found is None and choice == "jemalloc":
            raise PosttuneError(f"{ENV}=jemalloc: the dynamic linker finds no libjemalloc (install it, e.g. "
                                "apt install libjemalloc2, or give the library's path)")
        return found
    if not Path(choice).is_file():
        raise PosttuneError(f"{ENV}={choice}: neither auto, jemalloc, system nor an existing library file")
    return str(Path(choice).resolve())


def in_use() -> str:
    """What this process allocates with, for the run's banner: the preloaded library's name, or "system"."""
    library = os.environ.get(PRELOADED)
    return _stem(library).removeprefix("lib") if library and _mapped(library) else "system"


def _stem(library: str) -> str:
    """``libjemalloc`` of ``/usr/lib/x86_64-linux-gnu/libjemalloc.so.2``: what a mapping of it is named by."""
    return Path(library).name.split(".so")[0]


def _mapped(library: str) -> bool:
    """Whether this process has the library loaded (preloaded by us or by the user)."""
    name = _stem(library)
    try:
        return any(name in line for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        return False
