"""Helpers for testing posttune plugins, importable without pytest.

- ``run_cli("ls", "families")``: `posttune` run in this process, its output captured (``CliResult``);
- ``posttune.testing.tiny``: tiny random transformers checkpoints written by transformers itself;
- ``posttune.testing.fixtures``: the pytest plugin (entry point ``pytest11``, loaded automatically)
  with the ``posttune_plugins``, ``register_plugin`` and ``posttune_cli`` fixtures.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass


@dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_cli(*argv: str) -> CliResult:
    """Run `posttune ARGV...` in this process and capture what it printed."""
    from posttune.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse exits for --help, --version and usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())
