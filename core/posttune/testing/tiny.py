"""Tiny random Hugging Face checkpoints for tests: real configs, real ``save_pretrained`` files.

    config = tiny_llama_config(num_key_value_heads=4)
    hf_model = save_tiny_hf_checkpoint(tmp_path / "ckpt", config)

Needs ``transformers`` (a test dependency, not a dependency of posttune). Models are fp32,
randomly initialised from a fixed seed, and use eager attention so they serve as a reference
independent of SDPA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def tiny_llama_config(**overrides: Any) -> transformers.LlamaConfig:
    """A 2-layer, hidden-64, vocab-512 LlamaConfig (GQA 4:2); ``overrides`` are HF config fields."""
    return _config(transformers.LlamaConfig, overrides)


def tiny_mistral_config(**overrides: Any) -> transformers.MistralConfig:
    """The same tiny shape as a MistralConfig with an 8-token sliding window."""
    return _config(transformers.MistralConfig, {"sliding_window": 8, **overrides})


def _config(cls: type, overrides: dict[str, Any]) -> Any:
    return cls(**{**TINY, **overrides})


def tiny_hf_model(config: transformers.PreTrainedConfig, *, seed: int = 0) -> transformers.PreTrainedModel:
    """A randomly initialised ``AutoModelForCausalLM`` in fp32 and eval mode, reproducible from ``seed``.

    transformers initialises biases to 0 and norm weights to 1; those are perturbed too, so a
    parity test notices a dropped bias or two swapped norms.
    """
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def save_tiny_hf_checkpoint(path: str | Path, config: transformers.PreTrainedConfig, *, seed: int = 0,
                            max_shard_size: str | int | None = None) -> transformers.PreTrainedModel:
    """Write a random checkpoint (config.json + safetensors, sharded with an index if
    ``max_shard_size`` is given, e.g. ``"100KB"``) and return the model that was saved."""
    model = tiny_hf_model(config, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(Path(path), **kwargs)
    return model


def native_from_hf(hf_model: Any, family: Any, converter: Any) -> Any:
    """``family``'s native model carrying ``hf_model``'s weights, copied through ``converter``.

    Built on the meta device from the HF config, materialised, then filled in memory (no files:
    the checkpoint loader is tested on its own), so a test exercises exactly the key map and the
    architecture.
    """
    import torch

    from posttune.modules import init_buffers

    config = hf_model.config.to_dict()
    with torch.device("meta"):
        model = family.build(**family.from_hf_config(config))
    model.to_empty(device="cpu")
    init_buffers(model)
    state = {}
    for key, tensor in hf_model.state_dict().items():
        mapped = converter.to_native(key, tensor, config)
        if mapped is not None:
            state[mapped[0]] = mapped[1]
    model.load_state_dict(state, strict=True)
    return model.to(hf_model.dtype).eval()
