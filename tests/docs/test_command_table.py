"""docs/config.md's command table against the commands themselves: every installed command (the core's
and the plugins') has a row, and the row names every option its `--help` shows, and nothing else."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import pytest

from doc_blocks import ROOT

TABLE = (ROOT / "docs" / "config.md").read_text(encoding="utf-8").split("## Commands", 1)[1].split("\n## ", 1)[0]
#: torchrun's options, documented once in the paragraph under the table
TORCHRUN = set(re.findall(r"`(--[a-z-]+)`", TABLE.split("torchrun options accepted by", 1)[1].split("\n\n")[0]))


def _rows() -> dict[str, str]:
    """`posttune NAME ...` (the first cell) -> that first cell, for every row of the table."""
    rows = {}
    for line in TABLE.splitlines():
        match = re.match(r"\| `posttune ([a-z][a-z-]*)([^`]*)` \|", line)
        if match:
            name = match.group(1)
            rows.setdefault(name, "")
            rows[name] += line.split(" | ")[0]
    return rows


#: in a fresh interpreter: building the parser loads every installed plugin, which must not happen
#: in the test process at collection (other tests count on the plugin set they install)
OPTIONS_SCRIPT = """
import argparse, json
from posttune.cli.main import build_parser

def options(parser):
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
        if action.help != argparse.SUPPRESS:  # an old spelling kept working, not shown (plot's --out)
            found |= {o for o in action.option_strings if o.startswith("--") and o != "--help"}
    return {o for o in found if "_" not in o or o.replace("_", "-") not in found}  # --nproc_per_node: an alias

parser = build_parser()
commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
print(json.dumps({name: sorted(options(sub)) for name, sub in commands.items()}))
"""


@functools.cache
def _commands() -> dict[str, set[str]]:
    """Every installed command -> the options its --help shows."""
    done = subprocess.run([sys.executable, "-c", OPTIONS_SCRIPT], capture_output=True, text=True, check=True)
    return {name: set(options) for name, options in json.loads(done.stdout).items()}


def test_every_command_has_a_row_and_every_row_a_command():
    rows, commands = _rows(), set(_commands())
    assert not commands - set(rows), f"docs/config.md has no row for: {sorted(commands - set(rows))}"
    assert not set(rows) - commands, ("docs/config.md documents commands that do not exist: "
                                      f"{sorted(set(rows) - commands)}")


@pytest.mark.parametrize("name", sorted(_rows()))
def test_a_commands_row_names_exactly_its_options(name):
    row = _rows()[name]
    documented = set(re.findall(r"--[a-z][a-z0-9-]*", row))
    if "[torchrun options]" in row:
        documented |= TORCHRUN
    options = _commands().get(name, set())
    assert options <= documented, f"`posttune {name}`: --help shows {sorted(options - documented)}, the table does not"
    assert documented <= options, f"`posttune {name}`: the table names {sorted(documented - options)}, --help does not"
