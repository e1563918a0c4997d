"""Reward functions named by reference in the config: TRL's ``reward_funcs`` written in the user's own file.

``method.rewards: [math_answer, my_rewards.py:brevity, mypackage.rewards:correct]``: a name holding a ``:`` is a
Python function, ``path/to/file.py:function`` (a file, read relative to the working directory) or
``module:function`` (an importable module; the working directory is on the path), rather than a registered reward
(whose names hold no ``:``). Each is called as TRL calls its reward functions, by keyword:
``fn(prompts=..., completions=..., completion_ids=..., **row_fields)``, and returns one float (or None) per
completion; an ``async def`` function is awaited. TRL's ``trainer_state``, ``log_metric`` and ``log_extra`` are
not passed: a function that requires one is refused before launch (give it a default to run here).
It runs in the training process; ``timeout_s`` or ``budget_s`` runs it isolated instead, one
completion at a time in worker processes under those limits, as the built-in ``math_answer``. Its name in the logs
(``reward/<name>``) is the function's own.

The function travels to worker processes and Ray actors as its reference (`PythonReward`), and is imported again
there, so it needs no packaging; a plugin (``posttune new plugin --kind reward``) is what to ship to others.

A checkpoint records each reward file's sha256 (``file_digests``, in the method's state), and a resume whose file
has changed since says so on stderr (``warn_changed_files``): a warning, since fixing a reward and resuming is
legitimate. A module reference is not fingerprinted: its code is a package's, possibly many files.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def is_reference(name: str) -> bool:
    """Whether a ``method.rewards`` name is a Python function's reference (registered names hold no ``:``)."""
    return ":" in name


@dataclass(frozen=True)
class PythonReward:
    """The function ``reference`` names, read from ``cwd`` (the process that resolved it): what a worker process
    or a Ray actor receives by pickle, and imports on its first call. In the process that resolved it, the
    function as it was then (``bound``): a run scores with one version of it, and the next run in the same
    process (a notebook's next cell) resolves it again, edits included."""

    reference: str
    cwd: str
    bound: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.reference.rpartition(":")[2]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **fields: Any) -> Any:
        if self.bound is None:  # a worker process or an actor: imported there once
            object.__setattr__(self, "bound", load(self.reference, self.cwd))
        result = self.bound(prompts=prompts, completions=completions, **fields)
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    def __getstate__(self) -> dict[str, Any]:  # the reference travels, not the function (its module is local)
        return {"reference": self.reference, "cwd": self.cwd, "bound": None}


#: what TRL passes a reward function beyond the rows' fields, and posttune does not
TRL_ONLY = ("trainer_state", "log_metric", "log_extra")


def python_reward(reference: str, cwd: str | None = None) -> PythonReward:
    """``reference`` read from ``cwd`` (default: the working directory) and its function imported now, so a bad
    one is a one-line error before launch (``ValueError``, naming what is missing)."""
    reward = PythonReward(reference, cwd or os.getcwd())
    function = load(reward.reference, reward.cwd)
    object.__setattr__(reward, "bound", function)
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return reward
    for name in TRL_ONLY:
        if name in parameters and parameters[name].default is inspect.Parameter.empty:
            raise ValueError(f"{reward.name} requires '{name}', which TRL passes and posttune does not; give it a "
                             f"default ({name}=None) to run here")
    return reward


def load(reference: str, cwd: str) -> Callable[..., Any]:
    """The function now: a file's as its content is (an edited file is read again), a module's as imported."""
    target, _, attribute = reference.rpartition(":")
    if not target or not attribute.isidentifier():
        raise ValueError(f"'{reference}' is not a Python function's reference: write path/to/file.py:function or "
                         "module:function")
    if target.endswith(".py"):
        module = _from_file(Path(cwd, target).expanduser())
    else:
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"cannot import module '{target}' ({type(exc).__name__}: {exc})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{target} has no function '{attribute}'")
    return function


def _from_file(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"no file {path}")
    # one module per file and content, under a name no import can clash with
    name = "posttune_reward_" + hashlib.sha1(str(path.resolve()).encode() + path.read_bytes()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{path} raised {type(exc).__name__} when imported: {exc}") from None
    return module


def file_digests(functions: Iterable[Any]) -> dict[str, str]:
    """The sha256 of each file that the ``PythonReward``s among ``functions`` read (``file.py:fn``), by the path as
    the config wrote it."""
    digests = {}
    for function in functions:
        if isinstance(function, PythonReward) and (target := function.reference.rpartition(":")[0]).endswith(".py"):
            digests[target] = hashlib.sha256(Path(function.cwd, target).expanduser().read_bytes()).hexdigest()
    return digests


def warn_changed_files(recorded: Mapping[str, str], now: Mapping[str, str]) -> None:
    """One ``posttune: warning:`` line per reward file whose content differs from the checkpoint's (``recorded``)."""
    for path, digest in now.items():
        before = recorded.get(path)
        if before is not None and before != digest:
            print(f"posttune: warning: method.rewards: {path} has changed since the checkpoint was written (sha256 "
                  f"{before[:12]}... then, {digest[:12]}... now): the resumed run scores with the file as it is now",
                  file=sys.stderr)
