"""`posttune config keys` / `config show`: every key discoverable with its default (issue 17).

The listing is checked against the dataclasses walked here independently, so a field added to
the schema or to a plugin's config shows up in `config keys` and docs/config.md by itself.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from posttune import first_party
from posttune.cli import config_keys
from posttune.config import load_config, validate
from posttune.config.schema import RunConfig, TrainConfig
from posttune.descriptors import MemoryTechnique, Method
from posttune.plugins import get_registry, hookimpl
from posttune.testing import run_cli

ROOT = Path(__file__).resolve().parents[2]
#: how `config keys` titles each kind's config dataclass (docs/config.md, "Reference")
TITLES = {"method": "method ({})", "parallel_plan": "parallel.options.{}",
          "memory_technique": "memory_options.{}", "reward_function": "rewards ({})",
          "metric_logger": "logging_options.{}"}
FIRST_PARTY = {"posttune", *(dist for names in first_party.NAMES.values() for dist in names.values())}


def walk(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field]]:
    """Every field of ``cls`` a config sets, as (dotted key, field), into nested, optional and listed dataclasses
    (not the ones YAML never sets, such as a dataset mixture's ``sources``, filled from a list)."""
    hints = typing.get_type_hints(cls)
    for f in (f for f in dataclasses.fields(cls) if f.init):
        key = f"{prefix}.{f.name}" if prefix else f.name
        yield key, f
        inner, suffix = _nested(hints[f.name])
        if inner is not None:
            yield from walk(inner, key + suffix)


def _nested(tp: Any) -> tuple[type | None, str]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    if dataclasses.is_dataclass(tp):
        return tp, ""
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0], "[]"
    if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
        return typing.get_args(tp)[1], ".<name>"  # e.g. models.<name>.path
    return None, ""


def expected_default(f: dataclasses.Field) -> Any:
    """The field's default as plain data: a section of defaults is ``{}``, no default is "required"."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return {}
    return [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value] \
        if isinstance(value, list) else value


def listed() -> dict[str, tuple[str, str, str]]:
    """`posttune config keys` as key -> (type, default, meaning), read from its printed columns."""
    result = run_cli("config", "keys")
    assert result.exit_code == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = re.split(r" {2,}", line)
        if len(cells) >= 3:  # a plugin's header line has two cells: its title and its provider
            rows[cells[0]] = (cells[1], cells[2], cells[3] if len(cells) > 3 else "")
    return rows


def plugin_configs() -> Iterator[tuple[str, type, str]]:
    """(title, config dataclass, distribution) of every installed plugin that has one."""
    registry = get_registry()
    for kind, title in TITLES.items():
        for item in registry.items(kind):
            config = getattr(item.descriptor, "config", None)
            if isinstance(config, type) and dataclasses.is_dataclass(config):
                yield title.format(item.descriptor.name), config, item.provenance.distribution


def check_listed(rows: dict[str, tuple[str, str, str]], cls: type, prefix: str, *, meanings: bool) -> None:
    for key, f in walk(cls, prefix):
        assert key in rows, f"`posttune config keys` does not list {key}"
        _type, default, meaning = rows[key]
        expected = expected_default(f)
        shown = default if default == "required" else yaml.safe_load(default)
        assert shown == expected, f"{key}: listed default {default!r}, the dataclass says {expected!r}"
        if meanings:
            assert meaning, f"{key}: no meaning; put a `# comment` on the field's line in {cls.__module__}"


def test_every_schema_field_is_listed_with_its_default_and_meaning():
    check_listed(listed(), RunConfig, "", meanings=True)


def test_every_installed_plugin_config_field_is_listed_with_its_default():
    rows = listed()
    configs = list(plugin_configs())
    assert configs, "no installed plugin has a config dataclass"
    for title, config, distribution in configs:
        check_listed(rows, config, title, meanings=distribution in FIRST_PARTY)


def test_ranges_show_as_allowed_values():
    rows = {key.key: key for group in config_keys.core_groups() for key in group.keys}
    assert rows["train.max_grad_norm"].allowed == "a number > 0; null: no clipping"
    assert rows["checkpoint.keep_last"].allowed == "a positive integer; null: keep every checkpoint"
    assert rows["train.scheduler"].allowed.startswith("constant | linear | cosine")


def test_keys_of_one_section():
    result = run_cli("config", "keys", "train")
    keys = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    assert result.exit_code == 0 and "train.lr" in keys and "train.eval_every" in keys
    assert all(key == "train" or key.startswith("train.") for key in keys), keys


def test_keys_of_the_method_section_include_each_method_plugin():
    stdout = run_cli("config", "keys", "method").stdout
    assert re.search(r"^method \(sft\)\.train_on_input +bool +false ", stdout, re.M) or \
        "sft" not in get_registry().names("method")
    assert "train.lr" not in stdout


@pytest.mark.parametrize("section, message", [
    ("trian", "posttune: error: config: trian: unknown section (did you mean 'train'?)\n"),
    ("zzz", "posttune: error: config: zzz: unknown section (sections: model, method,"),
])
def test_unknown_section_is_one_line_naming_it(section, message):
    result = run_cli("config", "keys", section)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


# ---- meanings from source comments -----------------------------------------------------------------

@dataclass(frozen=True)
class Commented:
    trailing: int = 1  # on its line
    #: a block above,
    #: joined into one line
    above: str = "x"
    helped: bool = field(default=False, metadata={"help": "from metadata"})  # the metadata wins
    bare: float = 0.5


def test_meanings_come_from_trailing_comments_blocks_above_and_metadata():
    assert config_keys.field_meanings(Commented) == {
        "trailing": "on its line", "above": "a block above, joined into one line", "helped": "from metadata"}


# ---- config show ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToyInner:
    depth: int = 3  # nested


@dataclass(frozen=True)
class ToyConfig:
    weight: float = 0.5  # a toy weight
    inner: ToyInner = field(default_factory=ToyInner)  # a nested section


@dataclass(frozen=True)
class ToyMemoryConfig:
    chunk: int = 64  # a toy chunk


class ToyPlugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_methods(self, register):
        register(Method("toy", ToyConfig, "sft", data=lambda *a: None, loss=lambda *a: None))

    @hookimpl
    def posttune_register_memory_techniques(self, register):
        register(MemoryTechnique("toymem", "loss", lambda *a: None, config=ToyMemoryConfig))


CONFIG = """\
model: {family: fam, size: tiny}
method: {name: toy, inner: {depth: 5}}
data:
  train: {path: d.jsonl}
train: {lr: 1e-4}
memory: [toymem]
"""


def test_show_prints_every_default_and_reloads_to_the_resolved_config(fake_plugin, register_plugin, tmp_path):
    from posttune.plan import resolve_plan

    register_plugin(ToyPlugin(), name="toy", distribution="posttune-toy")
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    overrides = ["train.batch_size=3", "~train.lr"]
    result = run_cli("config", "show", str(path), *overrides)
    assert result.exit_code == 0, result.stderr
    reloaded = yaml.safe_load(result.stdout)
    config = validate(reloaded)
    assert config_keys.plain(config) == reloaded  # nothing left to fill in: every default is there
    original = resolve_plan(validate(load_config(path, overrides)), get_registry())
    again = resolve_plan(config, get_registry())
    assert again.method_config == original.method_config == ToyConfig(inner=ToyInner(depth=5))
    assert again.memory_options == original.memory_options == {"toymem": ToyMemoryConfig()}
    assert reloaded["method"] == {"name": "toy", "weight": 0.5, "inner": {"depth": 5}}
    assert reloaded["memory_options"] == {"toymem": {"chunk": 64}}
    unchanged = {f.name for f in dataclasses.fields(RunConfig)} - {"method", "memory_options"}
    for name in unchanged:
        assert getattr(config, name) == getattr(original.config, name), name
    assert (config.train.batch_size, config.train.lr) == (3, TrainConfig().lr)


def test_show_refuses_an_invalid_config_like_train(fake_plugin, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {family: fam, size: tiny}\nmethod: fsft\ntrain: {lrr: 1}\n")
    result = run_cli("config", "show", str(path))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "posttune: error: config: train.lrr: unknown key (did you mean 'lr'?)\n"


# ---- docs/config.md -------------------------------------------------------------------------------

def test_docs_reference_is_generated_from_the_dataclasses():
    registry = get_registry()
    installed = {item.provenance.distribution for kind in TITLES for item in registry.items(kind)}
    missing = sorted({dist for kind in TITLES for dist in first_party.NAMES.get(kind, {}).values()} - installed)
    if missing:
        pytest.skip(f"docs/config.md documents first-party plugins not installed here: {', '.join(missing)}")
    document = (ROOT / "docs" / "config.md").read_text()
    start, end = document.find(config_keys.START), document.find(config_keys.END)
    assert 0 <= start < end, f"docs/config.md lacks the markers {config_keys.START} ... {config_keys.END}"
    current = document[start:end + len(config_keys.END)]
    generated = config_keys.markdown(config_keys.documented(config_keys.all_groups()))
    assert current == generated, ("docs/config.md's Reference differs from the config dataclasses; "
                                  f"regenerate it: {config_keys.REGENERATE}")


def test_docs_example_is_labelled_as_an_example():
    document = (ROOT / "docs" / "config.md").read_text()
    example = document.split("```yaml", 1)[1].split("```", 1)[0]
    assert "not the defaults" in example.splitlines()[1]


def test_config_keys_does_not_import_torch():
    code = textwrap.dedent("""
        import sys
        from posttune.testing import run_cli
        assert run_cli("config", "keys").exit_code == 0
        print("torch" in sys.modules)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run.stderr
