"""What a config requires: its ``requires:`` list (PEP 508 requirements) against installed distributions,
and a CUDA device for the techniques that need one."""

from __future__ import annotations

from importlib import metadata
from typing import Any

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


def require_cuda(config: Any, technique: str, why: str) -> None:
    """Refuse a CUDA-only technique before launch when the run will not have a CUDA device."""
    device = config.train.device
    if device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    else:
        cuda = device.startswith("cuda")
    if not cuda:
        shown = "no CUDA device is available" if device == "auto" else f"train.device is '{device}'"
        raise ConfigError("memory", f"'{technique}' needs a CUDA device ({why}); {shown}")
