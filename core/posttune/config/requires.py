"""What a config requires: its ``requires:`` list (PEP 508 requirements) against installed distributions,
a CUDA device for the techniques that need one, and the device a run or command asks for."""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

from posttune.errors import ConfigError, PosttuneError, first_line


def check_requires(requirements: list[str]) -> None:
    """Every requirement met, or one line naming all that are not, with one ``pip install`` line for them."""
    unmet: dict[str, str] = {}  # requirement -> why it is unmet
    for index, text in enumerate(requirements):
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:  # packaging's message goes on with a caret diagram of the text
            raise ConfigError(f"requires[{index}]", f"invalid requirement {text!r}: {first_line(str(exc))}") from None
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            unmet[text] = "which is not installed"
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            unmet[text] = f"but {requirement.name} {installed} is installed"
    if unmet:
        raise PosttuneError(f"config requires {'; and '.join(f'{text}, {why}' for text, why in unmet.items())} — "
                            f"pip install {' '.join(repr(text) for text in unmet)}")


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


#: the device types a run can train on, as torch spells them (``cuda:1``): checked without torch
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|hpu|npu|xla|mtia)(:\d+)?$")


def device_for(name: str | None, where: str, *, here: bool = True) -> str:
    """``name`` (``auto``, ``cpu``, ``cuda``, ``cuda:1`` ...) checked, in one line naming ``where``
    (``config: train.device``, ``generate: --device``); ``auto`` is CUDA when a GPU is there, else the CPU.

    ``here=False`` checks only that it names a device, without importing torch (`posttune validate` stays
    fast, and may run on a laptop for a GPU run); the launch checks it ``here``, before a weight is read."""
    if name in (None, "auto") and not here:
        return "auto"
    if name is not None and name.split(":")[0] == "meta":
        raise PosttuneError(f"{where} meta holds no weights; use auto, cpu or cuda")
    if not here:
        if not _DEVICE.match(name):
            raise PosttuneError(f"{where} {name!r} is not a device (auto, cpu, cuda, cuda:1 ...)")
        return name
    import torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise PosttuneError(f"{where} {name!r} is not a device (auto, cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PosttuneError(f"{where} {name}: no CUDA device is available here (use cpu or auto)")
    count = torch.cuda.device_count()
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise PosttuneError(f"{where} {name}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})")
    if device.type not in ("cpu", "cuda"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as error:
            reason = first_line(str(error)).split(". ")[0]
            raise PosttuneError(f"{where} {name} is not usable here: {reason}") from None
    return name
