"""The adapter kind ``ia3``: IA³ (Liu et al. 2022), a learned scale on each output row of a frozen layer,
saved in PEFT's IA3 layout (``peft.PeftModel.from_pretrained`` loads it), written against ``posttune.plugin``.

    adapter: {kind: ia3, targets: [attn.k_proj, attn.v_proj, mlp.down_proj]}

``y = l * (W x)``, ``l`` starting at ones (a fresh adapter changes nothing), so the merged weight is ``l[:, None] * W``.
Every target is scaled on its output (PEFT's ``feedforward_modules`` empty). Layers with a bias are refused
(``l * (W x + b)`` would need the bias merged too), as are converters that reorder a weight's rows (Llama's q/k
RoPE permutation): the saved vector follows the Hugging Face rows only where they are the native ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from posttune.plugin import (
    ADAPTER_CONFIG,
    AdaptedLinear,
    AdapterKind,
    ConfigError,
    PosttuneError,
    adapted_modules,
    apply_adapters,
    copy_into,
    family_io,
    hf_modules,
    read_adapter_config,
)
from torch import nn

WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


class IA3Linear(AdaptedLinear):
    kind = "ia3"

    def __init__(self, base: nn.Linear, dtype: torch.dtype | None = None):
        super().__init__(base)
        if base.bias is not None:
            raise PosttuneError("ia3: a layer with a bias is not adapted here (its bias would need the scale too)")
        weight = base.weight
        self.ia3_l = nn.Parameter(torch.ones(base.out_features, device=weight.device, dtype=dtype or weight.dtype))

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        self.ia3_l.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out if self.disabled else out * self.ia3_l.to(out.dtype)

    def effective_weight(self) -> torch.Tensor:
        return self.ia3_l.to(self.base.weight.dtype).unsqueeze(1) * self.base.weight

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = self.base.weight
        return (self.ia3_l.float().unsqueeze(1) * weight.float()).to(dtype or weight.dtype)


def wrap(linear: Any, adapter: Any, dtype: Any) -> Any:
    return IA3Linear(linear, dtype)


def _hf_names(model: Any) -> dict[str, str]:
    _, converter, hf_config = family_io(model)
    names, fused = hf_modules(model, converter.from_native, hf_config)
    for name, layer in adapted_modules(model).items():
        if names[name] in fused:
            raise PosttuneError(f"ia3: '{name}' is fused into '{names[name]}' in the checkpoint; not supported here")
        probe = layer.base.weight.detach()
        converted = converter.from_native(f"{name}.weight", probe, hf_config)
        if converted is None or converted[1] is not probe:
            raise PosttuneError(f"ia3: the converter changes '{name}.weight' (rows reordered); not supported here")
    return names


def save(model: Any, directory: Path, *, state_dict: Any = None) -> Path:
    import json

    from safetensors.torch import save_file

    layers = adapted_modules(model)
    names = _hf_names(model)
    origin, _, _ = family_io(model)
    tensors = {}
    for name, layer in layers.items():
        vector = state_dict[f"{name}.ia3_l"] if state_dict is not None else layer.ia3_l
        tensors[f"{PREFIX}{names[name]}.ia3_l"] = vector.detach().to("cpu").reshape(-1, 1).contiguous()
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "IA3", "task_type": "CAUSAL_LM", "base_model_name_or_path": origin.source,
              "target_modules": sorted(names[name] for name in layers), "feedforward_modules": [],
              "fan_in_fan_out": False, "init_ia3_weights": True, "inference_mode": True, "modules_to_save": None}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return directory


def load(model: Any, directory: Path) -> list[str]:
    from safetensors.torch import load_file

    config = read_adapter_config(directory)
    if config.get("feedforward_modules"):
        raise PosttuneError(f"{directory}: ia3 here scales outputs only; feedforward_modules must be empty")
    saved = load_file(str(directory / WEIGHTS))
    _, converter, hf_config = family_io(model)
    native = {hf: name for name, hf in hf_modules(model, converter.from_native, hf_config)[0].items()}
    vectors = {native[key.removeprefix(PREFIX).removesuffix(".ia3_l")]: value for key, value in saved.items()}
    if not adapted_modules(model):
        apply_adapters(model, targets=sorted(vectors), wrap=IA3Linear)
    layers = adapted_modules(model)
    if set(layers) != set(vectors):
        raise PosttuneError(f"{directory}: its layers {sorted(vectors)} are not the model's {sorted(layers)}")
    for name, layer in layers.items():
        copy_into(layer.ia3_l, vectors[name].reshape(-1).to(layer.ia3_l.dtype))
    _hf_names(model)  # the same refusals as a save
    return list(layers)


def validate(adapter: Any) -> None:
    if adapter.loraplus_lr_ratio is not None:
        raise ConfigError("adapter.loraplus_lr_ratio", "ia3 has no B matrices to speed up; remove it")


def register_adapter_kinds(register: Any) -> None:
    register(AdapterKind("ia3", wrap, save, load, lambda config: config.get("peft_type") == "IA3", validate,
                         description="IA3: a learned scale on each output row of the frozen layers"))
