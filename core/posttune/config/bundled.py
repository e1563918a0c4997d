"""Find a config by path or bundled name; resolve ``package:`` paths inside it.

Bundled configs point at files their plugin ships (a demo dataset, a tokenizer) as
``package:posttune_llama/demo/reverse_train.jsonl``: the path inside an installed package,
valid wherever the config is copied to with `posttune cp`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from posttune import first_party
from posttune.errors import PosttuneError, did_you_mean


def resolve_config_path(source: str | Path) -> Path:
    path = Path(source)
    if path.exists() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        if not path.exists():
            raise PosttuneError(f"config file not found: {path}")
        return path
    from posttune.plugins import get_registry

    registry = get_registry()
    found = registry.entries["config"].get(str(source))
    if found is None:  # a first-party distribution's that is not installed is named with its pip install line
        name, theirs = str(source), first_party.NAMES["config"]
        message = f"no config file or bundled config named '{name}'"
        distribution = theirs.get(name)
        if distribution is not None:
            message += f": {distribution} bundles it"
        else:
            suggestion = did_you_mean(name, [*registry.names("config"), *theirs])
            message += suggestion
            close = suggestion.split("'")[1] if suggestion else None
            distribution = None if close in registry.entries["config"] else theirs.get(close)
        raise PosttuneError(message + (first_party.install_hint(distribution) or " (see `posttune ls configs`)"))
    return found.descriptor.path


def configs_in(folder: Path) -> list:
    """A plugin's bundled configs: every ``*.yaml`` in ``folder``, named by its file name and
    described by its ``description:`` line (what `posttune ls configs` shows)."""
    from posttune.descriptors import BundledConfig

    found = []
    for path in sorted(Path(folder).glob("*.yaml")):
        about = next((line.split(":", 1)[1].strip() for line in path.read_text(encoding="utf-8").splitlines()
                      if line.startswith("description:")), "")
        found.append(BundledConfig(path.stem, path, about))
    return found


PACKAGE = "package:"
#: config fields that hold paths (dotted); only these are resolved
PATH_FIELDS = ("model.path", "tokenizer.path", "tokenizer.chat_template", "data.train.path", "data.validation.path")


def resolve_package_paths(raw: dict[str, Any]) -> dict[str, Any]:
    models = raw.get("models")
    roles = [f"models.{role}.path" for role in models] if isinstance(models, dict) else []
    for dotted in [*PATH_FIELDS, *roles]:
        *parents, key = dotted.split(".")
        nodes: list[Any] = [raw]
        for part in parents:  # a list on the way (a dataset mixture): each of its entries
            nodes = [node.get(part) if isinstance(node, dict) else None for node in nodes]
            nodes = [item for node in nodes for item in (node if isinstance(node, list) else [node])]
        for node in nodes:
            if isinstance(node, dict) and isinstance(node.get(key), str) and node[key].startswith(PACKAGE):
                node[key] = str(package_path(node[key], dotted))
    return raw


def package_path(value: str, where: str) -> Path:
    """``package:pkg/sub/file`` -> the file inside installed package ``pkg``."""
    package, _, inner = value[len(PACKAGE):].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        from posttune.errors import ConfigError

        raise ConfigError(where, f"{value}: package '{package}' is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / inner
