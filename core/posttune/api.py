"""The Python API: load, build and save models, load tokenizers (``posttune.train``: `posttune.runs`).

    import posttune

    model = posttune.load_model("meta-llama/Llama-3.2-1B", dtype="bfloat16")  # or a local dir
    tokenizer = posttune.load_tokenizer("meta-llama/Llama-3.2-1B")
    posttune.save_model(model, "out/llama-sft", tokenizer=tokenizer)  # transformers loads it

    tiny = posttune.build_model(family, size, num_layers=2)  # random weights: a family's size by name

Models are plain ``torch.nn.Module``s returning logits; each remembers its family and the
config it came from (``posttune.checkpoint.origin``), which is all ``save_model`` needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttune.errors import UnknownNameError, did_you_mean

if TYPE_CHECKING:
    import torch


def load_model(path_or_id: str | Path, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None, family: str | None = None) -> torch.nn.Module:
    """A Hugging Face checkpoint (local directory or hub id) as a native model, in eval mode.

    ``dtype=None`` keeps the checkpoint's own dtype (config.json ``dtype``/``torch_dtype``),
    float32 when it names none. ``device=None`` means CPU. ``family`` overrides the family
    found from config.json ``architectures``.
    """
    from posttune.checkpoint.hf_load import load_hf

    return load_hf(path_or_id, dtype=dtype, device=device, family=family)


def save_model(model: torch.nn.Module, out_dir: str | Path, *, tokenizer: Any = None,
               max_shard_size: int | str | None = None) -> Path:
    """Write a posttune model as a checkpoint ``transformers.AutoModelForCausalLM`` loads.

    Atomic: ``out_dir`` holds either the previous checkpoint or the complete new one, never
    a mix. ``max_shard_size`` is bytes or a string such as "500MB" or "2GiB"; None means
    5GB. Weights beyond one shard go to numbered shards plus model.safetensors.index.json.
    """
    from posttune.checkpoint.hf_save import DEFAULT_MAX_SHARD_SIZE, save_hf

    return save_hf(model, out_dir, tokenizer=tokenizer, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)


def build_model(family: str, size: str | None = None, *, dtype: torch.dtype | str | None = None,
                device: torch.device | str | None = None, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised model of a family's named size, with ``overrides`` on its kwargs.

    Saving it writes config.json from the family's ``to_hf_config``.
    """
    from posttune.checkpoint import materialize as mat
    from posttune.checkpoint.origin import ModelOrigin, attach
    from posttune.plugins import get_registry

    descriptor = get_registry().get("model_family", family)
    if size is not None and size not in descriptor.sizes:
        sizes = ", ".join(descriptor.sizes) or "none"
        raise UnknownNameError(f"model family '{family}' has no size '{size}' (sizes: {sizes})"
                               f"{did_you_mean(size, descriptor.sizes)}")
    kwargs = {**(descriptor.sizes.get(size, {}) if size is not None else {}), **overrides}
    model = mat.build(descriptor.build, kwargs, mat.resolve_dtype(dtype), device or "cpu")
    mat.init_buffers(model)
    attach(model, ModelOrigin(descriptor.name, kwargs))
    return model


def load_tokenizer(path_or_id: str | Path) -> Any:
    """The checkpoint's tokenizer (``tokenizer.json``) with its own chat template."""
    from posttune.tokenizer import load_tokenizer as load

    return load(path_or_id)
