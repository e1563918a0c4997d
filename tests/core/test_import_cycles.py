"""No two core modules import each other, directly or through a third (imports inside functions
count; ``if TYPE_CHECKING:`` blocks and a package importing its own submodules do not)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"


def modules() -> dict[str, Path]:
    found = {}
    for path in (CORE / "posttune").rglob("*.py"):
        name = ".".join(path.relative_to(CORE).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """What ``path`` imports: ``from pkg import sub`` counts as importing ``pkg.sub`` alone."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def graph() -> dict[str, set[str]]:
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in known.items():
        targets = {owner(imported) for imported in imports(path, known)} - {None, name}
        edges[name] = targets
    return edges


def cycle_from(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_core_modules_have_no_import_cycles():
    edges = graph()
    assert "posttune.tokenizer_files" in edges["posttune.tokenizer"]  # the graph sees imports
    cycles = {" -> ".join(found) for name in edges if (found := cycle_from(name, edges))}
    assert cycles == set()
