"""Errors a user can fix. The CLI prints them as one line on stderr and exits with status 2, or with
``RETRY`` (75, EX_TEMPFAIL) for a failure of the machine that the same command may get past: an
orchestrator requeues those, and not a config error."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


#: the exit status of a failure worth retrying as it is (a rank killed by a signal, the output directory still
#: held by the run a requeue replaces)
RETRY = 75


class PosttuneError(Exception):
    """A problem in what the user asked for (config, plugins, paths), not a bug in posttune."""

    exit_status = 2


class RetryableError(PosttuneError):
    """A failure of the machine, not of what was asked: the same command may succeed later."""

    exit_status = RETRY


class ConfigError(PosttuneError):
    """A config value is missing, unknown or of the wrong type. ``path`` is the dotted field path."""

    def __init__(self, path: str, problem: str):
        self.path = path
        self.problem = problem
        where = f"{path}: " if path else ""
        super().__init__(one_line(f"config: {where}{problem}"))


class PluginError(PosttuneError):
    """A plugin could not be loaded, or what it registered is unusable."""


class UnknownNameError(PosttuneError):
    """A name (model family, method, plan, ...) that no installed plugin registered."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string; case is ignored (``GRPO``, ``DPO``)."""
    choices = list(choices)
    same = [choice for choice in choices if choice.lower() == word.lower()]
    close = same or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    starts = [choice for choice in choices if len(word) >= 3 and choice.lower().startswith(word.lower())]
    close = close or (starts if len(starts) == 1 else [])  # a name cut short: `int4` for `int4_weight_only`
    return f" (did you mean '{close[0]}'?)" if close else ""


def first_line(text: str) -> str:
    """The first non-empty line, stripped: one-line errors quote only that much of a message."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped (``\\n``): a key or value the
    user typed may hold them, and an error is one line on stderr."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
