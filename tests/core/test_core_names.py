"""The core names no first-party plugin (docs/architecture.md, "The core's open sets").

Every mesh dimension, model role, method, model family, parallel plan, memory technique and adapter kind that
a first-party distribution registers is collected from the registry, and the core's source is
searched for it: as a string literal of its own, quoted or in backticks inside a string
(docstrings included), as an attribute name (``config.teacher``, not a method call such as
``re.compile(...)``), or, for a name no prose uses
(one with a digit or an underscore: ``fsdp2``, ``dp_shard``), anywhere in a string. ``first_party.py`` is the one
exception: its install hints and the old spellings configs may still use.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

import posttune
from posttune.plugins import get_registry

CORE = Path(posttune.__file__).resolve().parent
EXEMPT = {CORE / "first_party.py"}
#: the core's own names that a first-party plugin's happen to share: (file, name) -> what it is
COINCIDENCES = {
    ("cli/commands.py", "cp"): "the core's `posttune cp` command (copy a bundled config)",
    # PPO's roles `value` and `reward` are also plain words and attributes
    ("builtin/datasets.py", "value"): "ShareGPT rows' message key",
    ("chat_messages.py", "value"): "ShareGPT rows' message key, in the hint for a turn of the other shape",
    ("cli/config_keys.py", "value"): "a parameter's name in a docstring",
    ("config/typed.py", "value"): "a parameter's name in a docstring",
    ("config/loader.py", "value"): "PyYAML nodes' attribute (a mapping node's pairs, a scalar's text)",
    ("generation.py", "value"): "an attribute of the core's own error",
    ("plugins.py", "value"): "importlib's EntryPoint.value",
    ("template_limits.py", "value"): "an ast node's value",
}
FIRST_PARTY = ("posttune-llama", "posttune-qwen", "posttune-gemma", "posttune-phi3", "posttune-sft", "posttune-dpo",
               "posttune-grpo", "posttune-kd", "posttune-rm", "posttune-ppo", "posttune-fsdp2", "posttune-tp",
               "posttune-cp", "posttune-ep", "posttune-loss-parallel", "posttune-memory", "posttune-torchao",
               "posttune-lora")


def first_party_names() -> dict[str, str]:
    """name -> what registers it, for everything the installed first-party distributions declare."""
    registry = get_registry()
    names: dict[str, str] = {}
    for kind in ("method", "model_family", "parallel_plan", "memory_technique", "adapter_kind"):
        for entry in registry.items(kind):
            where = entry.provenance.distribution
            if where in FIRST_PARTY:
                names[entry.descriptor.name] = f"{kind} of {where}"
                if kind == "parallel_plan" and entry.descriptor.mesh_dim is not None:
                    names[entry.descriptor.mesh_dim.name] = f"mesh dimension of {where}"
                if kind == "method":
                    for role in entry.descriptor.model_roles(entry.descriptor.config()):
                        names[role.name] = f"model role of {where}"
    return names


def namings(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each way ``source`` names one of ``names`` (see the module docstring)."""
    quoted = re.compile(rf"""(?:``|`|'|")({'|'.join(map(re.escape, sorted(names)))})(?:``|`|'|")""")
    # a name with a digit or underscore is a name wherever it stands (not a call: torch's ``loss_parallel()``)
    coined = sorted(name for name in names if re.search(r"[\d_]", name))
    bare = re.compile(rf"(?<![\w.-])({'|'.join(map(re.escape, coined))})(?![\w(-])") if coined else None
    found, previous = [], None
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for token, following in zip(tokens, tokens[1:] + [None]):
        if token.type == tokenize.STRING or token.type == getattr(tokenize, "FSTRING_MIDDLE", None):
            body = token.string
            matches = {(match.start(1), match[1]) for match in quoted.finditer(body)}
            matches |= {(match.start(1), match[1]) for match in bare.finditer(body)} if bare else set()
            found += [(token.start[0] + body[:start].count("\n"), name) for start, name in sorted(matches)]
        elif (token.type == tokenize.NAME and token.string in names and previous == "."
              and not (following is not None and following.string == "(")):  # a method call: ``re.compile(``
            found.append((token.start[0], token.string))
        previous = token.string if token.type == tokenize.OP else None
    return found


@pytest.fixture(scope="module")
def registered():
    """The first-party names; skipped only where a first-party distribution is not installed at all (an
    installed one that registers nothing is a failure, not a skip)."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name in FIRST_PARTY:
        try:
            distribution(name)
        except PackageNotFoundError:
            pytest.skip(f"{name} is not installed: the core is checked against every first-party distribution")
    names = first_party_names()
    assert {"sft", "fsdp2", "dp_shard", "reference", "qlora_nf4", "llama"} <= set(names)
    return names


def test_the_core_source_names_no_first_party_name(registered):
    offences = []
    for path in sorted(CORE.rglob("*.py")):
        if path in EXEMPT:
            continue
        for line, name in namings(path.read_text(), set(registered)):
            if (path.relative_to(CORE).as_posix(), name) in COINCIDENCES:
                continue
            offences.append(f"{path.relative_to(CORE.parent)}:{line}: {name!r} ({registered[name]})")
    assert not offences, "\n".join(offences)


def test_the_search_finds_each_way_of_naming():
    names = {"tp", "teacher", "grpo", "fsdp2"}
    source = 'DIM = "tp"\ndef f(config):\n    """Reads ``teacher``."""\n    return config.teacher, f"{1} \'grpo\'"\n'
    assert sorted(namings(source, names)) == [(1, "tp"), (3, "teacher"), (4, "grpo"), (4, "teacher")]
    assert namings('"""A teacher and a grpo run; stp, tpx."""\nteacher = 1\n', names) == []
    assert namings('PATTERN = re.compile("x")\n', {"compile"}) == []
    assert namings('options = config.compile\n', {"compile"}) == [(1, "compile")]
    assert namings('"""Line one,\nthen before fsdp2 (not fsdp2x, not torch fsdp2())."""\n', names) == [(2, "fsdp2")]
