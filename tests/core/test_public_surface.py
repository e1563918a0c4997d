"""The public plugin surface: first-party plugins import nothing else from the core, every name
the surface exports resolves, is documented and is used by a plugin (first-party, or the
third-party example under tests/third_party), and shipped code never needs ``posttune.testing``."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import posttune.plugin as surface

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_FOLDERS = ("posttune_models", "posttune_methods", "posttune_parallel", "posttune_trackers", "plugins")
#: what a plugin's shipped code may import from the core, exactly (a module inside one is private): the
#: surface, the model building blocks, and the package root (``hookimpl``, ``__version__``)
ALLOWED = ("posttune", "posttune.plugin", "posttune.modules")
#: what a plugin's tests may import besides: the test helpers
TEST_ONLY = ("posttune.testing", "posttune.tiny_tokenizer")
#: plugins written as a third party would, which use names no first-party plugin needs
THIRD_PARTY = (ROOT / "tests" / "third_party" / "posttune_thirdparty", ROOT / "plugins" / "template")


def plugin_sources() -> list[Path]:
    files = []
    for folder in PLUGIN_FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*.py") if ".egg-info" not in str(p) and "build" not in p.parts]
    return sorted(files)


def core_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a ``posttune`` module (not ``posttune_*`` packages)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name == "posttune" or name.startswith("posttune.")]
    return found


def is_test(path: Path) -> bool:
    return "tests" in path.parts or path.name.startswith("test_") or path.name == "conftest.py"


def allowed(module: str, *, test: bool = False) -> bool:
    return module in ALLOWED or test and module in TEST_ONLY


def test_first_party_plugins_import_only_the_public_surface():
    sources = plugin_sources()
    assert len(sources) > 40  # every distribution folder was found
    private = [f"{path.relative_to(ROOT)}:{line}: {module}" for path in sources
               for line, module in core_imports(path) if not allowed(module, test=is_test(path))]
    assert private == []


def test_the_check_sees_a_private_or_deep_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from posttune.training import distributed\nfrom posttune.plugin import Method\n"
                   "import posttune.modules.rope\nfrom posttune.modules import Decoder\n"
                   "from posttune.tiny_tokenizer import save_tiny_tokenizer\n")
    assert [m for _, m in core_imports(bad) if not allowed(m)] == ["posttune.training", "posttune.modules.rope",
                                                                   "posttune.tiny_tokenizer"]
    assert [m for _, m in core_imports(bad) if not allowed(m, test=True)] == ["posttune.training",
                                                                              "posttune.modules.rope"]


def test_every_exported_name_is_used_by_a_plugin():
    """A name no plugin imports is a name to maintain for nobody: first-party plugins, the template and the
    third-party example (tests/third_party) between them use every one."""
    sources = [path for path in plugin_sources() if not is_test(path)]
    for folder in THIRD_PARTY:
        sources += [path for path in folder.rglob("*.py") if not is_test(path.relative_to(folder))]
    used = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "posttune.plugin":
                used |= {alias.name for alias in node.names}
    assert sorted(set(surface.__all__) - used) == []


def test_the_testing_helpers_import_pytest_only_for_their_fixtures():
    import subprocess

    code = ("import sys; import posttune.testing, posttune.tiny_tokenizer; "
            "from posttune.testing import run_cli; print('pytest' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("name", surface.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(surface, name) is not None


def test_importing_the_surface_for_registration_does_not_import_torch():
    code = ("import sys; import posttune.plugin as p; p.Method, p.hookimpl, p.configs_in; "
            "print('torch' in sys.modules)")
    import subprocess

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_every_exported_name_is_documented_in_the_plugin_guide():
    guide = (ROOT / "docs" / "plugins.md").read_text()
    missing = [name for name in surface.__all__ if f"`{name}`" not in guide]
    assert missing == []


def test_lookup_finds_registered_descriptors(posttune_plugins):
    assert surface.lookup("dataset_format", "preference").kind == "preference"
    assert "chat" in surface.registered("dataset_format")
    with pytest.raises(surface.PosttuneError, match="no method 'nope' is installed"):
        surface.lookup("method", "nope")


def test_the_surface_names_match_their_core_definitions():
    for name in ("build_loader", "token_logps", "derive_seed", "BatchLoader", "adapted_modules"):
        module = importlib.import_module(surface._LAZY[name])
        assert getattr(surface, name) is getattr(module, name)
