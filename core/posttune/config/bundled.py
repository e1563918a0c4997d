"""Find a config by path, or by the name of a bundled config that a plugin registered."""

from __future__ import annotations

from pathlib import Path

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
    if found is None:
        names = registry.names("config")
        raise PosttuneError(
            f"no config file or bundled config named '{source}'{did_you_mean(str(source), names)}"
            " (see `posttune ls configs`)"
        )
    return found.descriptor.path
