"""Check a config's ``requires:`` list (PEP 508 requirements) against installed distributions."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement

from posttune.errors import ConfigError, PosttuneError


def check_requires(requirements: list[str]) -> None:
    for index, text in enumerate(requirements):
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise ConfigError(f"requires[{index}]", f"invalid requirement {text!r}: {exc}") from None
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            raise PosttuneError(
                f"config requires {text}, which is not installed — pip install '{text}'"
            ) from None
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            raise PosttuneError(
                f"config requires {text}, but {requirement.name} {installed} is installed"
                f" — pip install '{text}'"
            )
