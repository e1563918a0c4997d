"""What the ``vllm`` engine builds its model from and checks each weight update against.

vLLM builds a model from a Hugging Face ``config.json`` and loads tensors under Hugging Face
names. The config is the checkpoint's own when the policy came from one (it keeps every field
posttune does not model), else the family's ``to_hf_config``. The tensors are the policy's plain
state dict (adapters folded in, shards gathered), renamed one at a time by the family's converter.

vLLM only logs a warning when an update leaves a weight out, so every state dict is checked here
first, by name and shape, against the family's own model built on the meta device: a state dict of
another architecture is refused before any tensor of the running engine changes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from posttune.plugin import PosttuneError, lookup

SHOWN = 3  # names listed in an error line


def hf_config_of(policy: Any) -> dict[str, Any]:
    """config.json for the policy: its checkpoint's, or the family's ``to_hf_config(build_kwargs)``."""
    origin = getattr(policy.model, "posttune_origin", None)
    if origin is not None and origin.hf_config is not None:
        return dict(origin.hf_config)
    if policy.source is not None and (Path(policy.source) / "config.json").is_file():
        return json.loads((Path(policy.source) / "config.json").read_text(encoding="utf-8"))
    family = lookup("model_family", policy.family)
    if family.to_hf_config is None:
        raise PosttuneError(f"generation engine 'vllm': model family '{policy.family}' cannot write config.json "
                            f"(no to_hf_config) and the policy has no checkpoint directory to read one from")
    return dict(family.to_hf_config(policy.build_kwargs))


def expected_shapes(family: str, build_kwargs: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a plain model of ``family`` (``plain_state_dict``'s names), with its shape."""
    with torch.device("meta"):
        model = lookup("model_family", family).build(**build_kwargs)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_state(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], version: int) -> None:
    """A one-line PosttuneError unless ``state`` has exactly the expected names and shapes."""
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    wrong = [f"{name} {tuple(state[name].shape)} (expected {expected[name]})" for name in state
             if name in expected and tuple(state[name].shape) != expected[name]]
    if missing or unexpected or wrong:
        parts = [f"{label} {names[:SHOWN]}" for label, names in
                 (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names]
        raise PosttuneError(f"generation engine 'vllm': the weights of version {version} do not fit the policy's "
                            f"architecture ({'; '.join(parts)}); nothing was loaded")


def dtype_of(policy: Any, hf_config: Mapping[str, Any], requested: str) -> str:
    """The dtype vLLM runs in: the requested one, else the policy's (its first floating tensor), else
    config.json's, else float32."""
    if requested != "auto":
        return requested
    if policy.model is not None:
        for tensor in policy.model.parameters():
            if tensor.is_floating_point():
                return str(tensor.dtype).removeprefix("torch.")
    return str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
