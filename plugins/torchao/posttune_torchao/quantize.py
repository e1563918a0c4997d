"""`posttune quantize`: a trained model exported with torchao weight-only quantization.

    posttune quantize --model runs/sft/model -o runs/sft/int8
    posttune quantize --adapter runs/lora/adapter --scheme int4_weight_only --group-size 64 -o runs/lora/int4

The float checkpoint (or a base model with a LoRA/DoRA adapter merged into it) is loaded as a
native model, its linear layers quantized with torchao's ``quantize_``, and written in the
format transformers 5 reads for ``TorchAoConfig``: ``quantization_config`` in config.json,
the weights flattened into ``model.safetensors`` with torchao's metadata (checkpoint.py).
transformers' ``from_pretrained(OUT)`` and ``posttune generate --model OUT`` load it.

What is quantized follows transformers' default, so both sides agree on the same file:
every ``nn.Linear`` except the output head (``lm_head``); embeddings and norms stay in the
checkpoint's float dtype.

Schemes and where they run (docs/quantize.md):

- ``int8_weight_only``: int8 weights with one scale per output row (or per ``--group-size``
  inputs), ``Int8Tensor``; CPU and CUDA; about half the bytes of bf16.
- ``int4_weight_only`` on CUDA: ``Int4WeightOnlyConfig`` packed two values a byte for the
  tinygemm kernel (``tile_packed_to_4d``, bfloat16); on CPU torchao 0.18 has no packed int4
  layout (``Int4CPULayout`` is gone, ``Int4Tensor`` needs CUDA kernels), so the export uses
  ``IntxWeightOnlyConfig(int4)``: the same int4 grid and group scales, each value stored in
  a byte (``IntxUnpackedToInt8Tensor``): int4 accuracy, int8 size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from posttune.plugin import Command, PosttuneError, device_for, did_you_mean

SCHEMES = ("int8_weight_only", "int4_weight_only")
INT4_GROUP_SIZE = 128  # torchao's and the published int4 checkpoints' default
#: the output embeddings: transformers leaves them unquantized by default, so do we
HEAD = "lm_head"
#: files of the source checkpoint not copied to the export (weights are rewritten, config.json edited)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory to quantize (posttune's save_model output); "
                                        "with --adapter: the base model (default: the one adapter_config.json names)")
    parser.add_argument("--adapter", help="a PEFT LoRA/DoRA adapter directory, merged into its base before quantizing")
    parser.add_argument("--scheme", default="int8_weight_only",
                        help="int8_weight_only (CPU and CUDA) or int4_weight_only (packed on CUDA; on CPU int4 "
                             "values stored one per byte) (default: int8_weight_only)")
    parser.add_argument("--group-size", type=int, default=None,
                        help=f"input features sharing one scale (default: a scale per output row for int8, "
                             f"{INT4_GROUP_SIZE} for int4); must divide every linear layer's input features")
    parser.add_argument("-o", "--output", required=True, help="directory to write; must not exist or be empty")
    parser.add_argument("--device", default="auto",
                        help="where to quantize and run the export: auto (cuda when available, else cpu), cpu, "
                             "cuda, cuda:1 ... (default: auto); int4's layout depends on it")


def run(args: argparse.Namespace) -> int:
    check_settings(args.scheme, args.group_size)
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PosttuneError(f"quantize: -o {out} exists and is not an empty directory; choose a new one")
    base, adapter = source_dirs(args.model, args.adapter)
    device = device_for(args.device, "quantize: --device")
    if device != "cpu" and not device.startswith("cuda"):
        raise PosttuneError(f"quantize: --device {device}: torchao's weight-only exports run on cpu or cuda")
    written = export(base, adapter, out, args.scheme, args.group_size, device)
    print(f"wrote {args.scheme} export ({_size(written)} of weights) to {out}")
    return 0


def source_dirs(model: str | None, adapter: str | None) -> tuple[Path, Path | None]:
    """(float checkpoint, adapter or None), both existing local directories."""
    if adapter is not None:
        adapter_dir = _existing(adapter, "--adapter", "adapter_config.json")
        if model is None:
            from posttune.plugin import adapter_base

            model = adapter_base(adapter_dir, "quantize")
        return _existing(model, "--model", "config.json"), adapter_dir
    if model is None:
        raise PosttuneError("quantize: give --model DIR (a saved checkpoint) or --adapter DIR (a PEFT adapter)")
    return _existing(model, "--model", "config.json"), None


def _existing(path: str, option: str, marker: str) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise PosttuneError(f"quantize: {option} {path}: no such directory")
    if not (directory / marker).is_file():
        raise PosttuneError(f"quantize: {option} {path}: no {marker} there")
    return directory


def check_settings(scheme: str, group_size: int | None) -> None:
    """Refuse a bad ``--scheme`` or ``--group-size`` before torchao is imported: its import prints lines of its
    own (kernels it cannot load, deprecations), which would bury the one-line error. Whether the group size
    divides each layer's inputs is known only once the model is loaded (quantized_state)."""
    if scheme not in SCHEMES:
        raise PosttuneError(f"quantize: --scheme {scheme!r}: expected one of {', '.join(SCHEMES)}"
                            f"{did_you_mean(scheme, SCHEMES)}")
    if group_size is not None and group_size <= 0:
        raise PosttuneError(f"quantize: --group-size {group_size}: expected a positive number of input features")


def quant_config(scheme: str, group_size: int | None, device: str) -> Any:
    """The torchao config for ``scheme`` on ``device`` (see the module docstring for why int4 differs)."""
    check_settings(scheme, group_size)
    import torch
    from torchao.quantization import (Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup,
                                      PerRow)

    if scheme == "int8_weight_only":
        return Int8WeightOnlyConfig(granularity=PerRow() if group_size is None else PerGroup(group_size))
    group_size = group_size or INT4_GROUP_SIZE
    if device.startswith("cuda"):
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d")
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


def export(base: Path, adapter: Path | None, out: Path, scheme: str, group_size: int | None, device: str) -> int:
    """Load, merge, quantize and write; returns the bytes of model.safetensors. The model loads before torchao is
    imported (quant_config), so a checkpoint or adapter it cannot read is refused without torchao's import noise."""
    import torch

    import posttune
    from posttune.plugin import load_adapter, merge_adapters

    model = posttune.load_model(base, device=device)
    if adapter is not None:
        load_adapter(model, adapter)
        merge_adapters(model)
    config = quant_config(scheme, group_size, device)
    if type(config).__name__ == "Int4WeightOnlyConfig":  # the tinygemm layout computes in bfloat16
        model.to(torch.bfloat16)
    hf_config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    converter = _converter(hf_config, base)
    state = quantized_state(model, config, converter, hf_config)
    return write(out, base, state, hf_config, config, _dtype_name(model))


def _converter(hf_config: dict[str, Any], where: Path) -> Any:
    """The ``FAMILY:hf`` converter of the family that reads ``hf_config`` (its ``architectures``)."""
    from posttune.plugin import lookup, registered

    architectures = set(hf_config.get("architectures") or ())
    for name in registered("model_family"):
        if architectures & set(lookup("model_family", name).architectures):
            return lookup("checkpoint_converter", f"{name}:hf")
    raise PosttuneError(f"quantize: {where}: no installed model family reads architectures {sorted(architectures)}")


def quantized_state(model: Any, config: Any, converter: Any, hf_config: dict[str, Any]) -> dict[str, Any]:
    """HF name -> tensor (torchao subclasses for the quantized weights), each tied tensor once."""
    from torch import nn
    from torchao.quantization import quantize_

    def hf_name(native: str, tensor: Any) -> str:
        return converter.from_native(native, tensor, hf_config)[0]

    group = getattr(getattr(config, "granularity", None), "group_size", None) or getattr(config, "group_size", None)

    def wanted(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        hf_module = hf_name(f"{name}.weight", module.weight).rpartition(".")[0]
        if hf_module == HEAD:
            return False
        if group is not None and module.in_features % group:
            raise PosttuneError(f"quantize: --group-size {group} does not divide the {module.in_features} input "
                                f"features of '{hf_module}'")
        return True

    chosen = [name for name, module in model.named_modules() if wanted(module, name)]
    if not chosen:
        raise PosttuneError("quantize: the model has no linear layer to quantize")
    quantize_(model, config, filter_fn=lambda module, name: name in chosen)
    state, seen = {}, set()
    for key, tensor in model.state_dict(keep_vars=True).items():  # keep_vars: tied weights are one object
        if id(tensor) in seen:
            continue  # a tied weight: transformers re-ties it from config.json's tie_word_embeddings
        seen.add(id(tensor))
        state[hf_name(key, tensor)] = tensor.detach()
    return state


def write(out: Path, base: Path, state: dict[str, Any], hf_config: dict[str, Any], config: Any, dtype: str) -> int:
    """The export in a sibling temporary directory, renamed to ``out`` once complete."""
    from safetensors.torch import save_file
    from torchao.core.config import config_to_dict

    from posttune_torchao.checkpoint import flatten

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    tmp.mkdir()  # not mkdtemp: the export gets the umask's permissions, as save_model's does
    try:
        for item in base.iterdir():  # tokenizer, chat template, generation_config.json
            if item.is_file() and item.name != "config.json" and not item.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(item, tmp / item.name)
        tensors, metadata = flatten(state)
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
        (tmp / "model.safetensors").chmod(0o666 & ~_umask())  # safetensors creates it owner-only
        hf_config = {**hf_config, "dtype": dtype, "quantization_config": {
            "quant_method": "torchao",  # what transformers' TorchAoConfig.to_dict writes
            "quant_type": {"default": config_to_dict(config)},
            "modules_to_not_convert": [HEAD],
            "include_input_output_embeddings": False,
            "untie_embedding_weights": False,
        }}
        hf_config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked before any work
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return (out / "model.safetensors").stat().st_size


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _dtype_name(model: Any) -> str:
    import torch

    dtypes = {p.dtype for p in model.parameters() if type(p.data) is torch.Tensor and p.is_floating_point()}
    return str(max(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else torch.float32).removeprefix("torch.")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


EXAMPLES = (
    "posttune quantize --model runs/sft/model -o runs/sft/int8",
    "posttune quantize --adapter runs/lora/adapter --scheme int4_weight_only --group-size 64 -o runs/lora/int4",
)

COMMAND = Command("quantize", "export a trained model with torchao int8/int4 weight-only quantization "
                              "(transformers loads it; posttune generate runs it)",
                  configure, run, examples=EXAMPLES)
