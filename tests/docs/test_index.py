"""docs/README.md (the newcomer's path) links every page, and no page links a file that is not there."""

from __future__ import annotations

import re

from doc_blocks import DOCS, ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {target for target in LINK.findall(index)}
    pages = {path.name for path in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert not pages - linked, f"docs/README.md does not link {sorted(pages - linked)}"


def test_relative_links_resolve():
    broken = []
    for path in DOCS:
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
