"""What the README and docs/ show: the commands in their code blocks and code spans, the output they
quote after a `$ command` line, and the `posttune: error:` lines they quote.

Plain line scanning, no Markdown library: a code block is a fenced block or an indented one (four
spaces after a blank line); a command is a line that starts with a program we ship or use
(`posttune`, `python -m posttune_...`, `pip install`, `tox`, ...). A comment after `#` is dropped,
a trailing backslash joins the next line, and `a && b` is two commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

PROGRAM = re.compile(r"^(posttune |posttune$|python3? -m (posttune|venv)|pip install|tox|torchrun|\. \.venv)")
SPAN = re.compile(r"`((?:posttune(?: [^`]*)?|python3? -m posttune_[^`]*))`")
ERROR = "posttune: error:"


@dataclass(frozen=True)
class Shown:
    """One command (or quoted error line) as the docs show it, with where."""

    text: str
    file: str
    line: int
    output: tuple[str, ...] = ()  # the lines a `$ command` block quotes after the command

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line inside a code block; a blank line between blocks becomes ''."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[tuple[int, str]] = []
    fenced = False
    indented = False
    previous_blank = True
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            out.append((number, ""))
            continue
        blank = not line.strip()
        if fenced:
            out.append((number, line))
        elif (line.startswith("    ") and (indented or previous_blank)
              and not line.lstrip().startswith(("- ", "* ", "|"))):
            indented = True
            out.append((number, line.strip()))
        else:
            if indented and blank:
                out.append((number, ""))
            indented = indented and blank
        previous_blank = blank
    return out


def _strip_comment(text: str) -> str:
    return re.sub(r"\s+#\s.*$", "", text).strip()


def _commands_and_transcripts(path: Path) -> tuple[list[Shown], list[Shown]]:
    commands: list[Shown] = []
    transcripts: list[Shown] = []
    lines = _code_lines(path)
    i = 0
    while i < len(lines):
        number, text = lines[i]
        i += 1
        stripped = text.strip()
        transcript = stripped.startswith("$ ")
        body = stripped[2:] if transcript else stripped
        if not PROGRAM.match(body):
            continue
        body = _strip_comment(body)
        while body.endswith("\\") and i < len(lines):
            body = body[:-1].rstrip() + " " + _strip_comment(lines[i][1].strip())
            i += 1
        output: list[str] = []
        if transcript:
            while i < len(lines) and lines[i][1].strip() and not lines[i][1].strip().startswith("$ "):
                output.append(lines[i][1])
                i += 1
            transcripts.append(Shown(body, str(path.relative_to(ROOT)), number, tuple(output)))
        for part in body.split(" && "):
            commands.append(Shown(part.strip(), str(path.relative_to(ROOT)), number))
    return commands, transcripts


def block_commands() -> list[Shown]:
    """Every command in a code block of README.md and docs/*.md."""
    return [c for path in DOCS for c in _commands_and_transcripts(path)[0]]


def transcripts() -> list[Shown]:
    """Every `$ command` block with the output lines it quotes."""
    return [t for path in DOCS for t in _commands_and_transcripts(path)[1]]


def span_commands() -> list[Shown]:
    """Every `posttune ...` / `python -m posttune_...` code span in the prose (not in code blocks)."""
    found = []
    for path in DOCS:
        in_code = {number for number, _ in _code_lines(path)}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if number in in_code:
                continue
            for match in SPAN.finditer(line):
                found.append(Shown(match.group(1).replace("\\|", "|").strip(), str(path.relative_to(ROOT)), number))
    return found


def quoted_errors() -> list[Shown]:
    """Every `posttune: error:` line the docs quote in a code block."""
    return [Shown(text.strip(), str(path.relative_to(ROOT)), number)
            for path in DOCS for number, text in _code_lines(path) if text.strip().startswith(ERROR)]
