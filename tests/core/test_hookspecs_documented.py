"""Meta-tests (as datasette has): every hook spec is documented and exercised by a test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from posttune import hookspecs
from posttune.registry import KINDS

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in vars(hookspecs).items() if name.startswith("posttune_") and callable(fn)]
THIS = Path(__file__).resolve()


def test_every_registration_kind_has_a_hook_spec():
    assert sorted(kind.hook for kind in KINDS.values()) == sorted(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_arguments(hook):
    arguments = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    heading = f"### `{hook}({arguments})`"
    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert heading in docs, f"docs/plugins.md lacks the heading {heading}"
    section = docs.split(heading, 1)[1].split("\n### ", 1)[0]
    assert "```python" in section and f"def {hook}(" in section, f"{hook}: the docs section needs an example"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_implemented_by_a_test(hook):
    pattern = re.compile(rf"(def {hook}\(|{hook}=)")
    sources = [p for p in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("plugins/*/tests/**/*.py")] if p != THIS]
    assert any(pattern.search(p.read_text()) for p in sources), f"no test implements {hook}"
