"""What a saved HF checkpoint says of itself, against the libraries that read it: the safetensors files byte for
byte as safetensors' own writer makes them (and flushed), the shards as huggingface_hub splits them, config.json's
dtype keys as transformers reads them, and a derived generation_config.json as transformers derives it."""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import transformers
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

import posttune
from posttune.checkpoint.hf_save import Planned, generation_config_for, split_shards
from posttune.checkpoint.safetensors_io import write_file
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

#: names whose JSON header is not a multiple of 8 bytes long: the writer pads it
TENSORS = {"a": torch.arange(3, dtype=torch.float32), "bcd": torch.ones(2, 3, dtype=torch.bfloat16)}


def planned(tensors: dict[str, torch.Tensor]) -> list[Planned]:
    return [Planned(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]


def test_a_written_file_is_byte_for_byte_safetensors_own(tmp_path, monkeypatch):
    flushed, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    write_file(tmp_path / "ours.safetensors", planned(TENSORS), TENSORS.__getitem__)
    save_file(TENSORS, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    assert struct.unpack("<Q", ours[:8])[0] % 8 == 0  # tensors start aligned for zero-copy readers
    assert flushed == [str(tmp_path / "ours.safetensors")]  # its data on disk before the checkpoint is renamed in


def test_a_tensor_that_changed_since_the_plan_is_refused(tmp_path):
    """The header is written from the plan before the data: a tensor of another dtype (same shape) would leave a
    file whose header lies."""
    with pytest.raises(RuntimeError, match="tensor 'a' changed between planning and writing"):
        write_file(tmp_path / "bad.safetensors", planned(TENSORS), lambda name: TENSORS[name].double())


@pytest.mark.parametrize("sizes, limit", [((4, 4), 8), ((4, 4, 4), 8), ((12, 4, 4), 8), ((2, 6, 8, 1, 1), 8),
                                          ((8,), 8), ((3, 3, 3, 3), 6)])
def test_shards_split_as_huggingface_hubs(sizes, limit):
    """float32 tensors of ``sizes`` elements x 4 bytes each, under a ``limit``-element shard size."""
    state = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    theirs = split_torch_state_dict_into_shards(state, max_shard_size=4 * limit)
    ours = [[item.name for item in shard] for shard in split_shards(planned(state), 4 * limit)]
    assert ours == [theirs.filename_to_tensors[name] for name in theirs.filename_to_tensors]


@pytest.fixture
def source(tmp_path):
    """A checkpoint whose config.json is an older transformers' (only ``torch_dtype``, bfloat16)."""
    save_tiny_hf_checkpoint(tmp_path / "src", tiny_llama_config())
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    return tmp_path / "src"


def stored_dtype(directory) -> str:
    """The floating dtype holding most bytes in the saved files, read from their headers."""
    kinds = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}
    held = Counter()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            for key in file.keys():
                part = file.get_slice(key)
                name, size = kinds[part.get_dtype()]
                held[name] += size * torch.Size(part.get_shape()).numel()
    return held.most_common(1)[0][0]


def test_both_dtype_keys_name_the_saved_weights(source, tmp_path):
    """transformers 4.x reads only ``torch_dtype``: left at bfloat16 over fp32 weights, it would load them as bf16."""
    posttune.save_model(posttune.load_model(source, dtype="float32"), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == stored_dtype(tmp_path / "out") == "float32"


def test_the_config_dtype_is_the_one_holding_most_bytes(source, tmp_path):
    model = posttune.load_model(source, dtype="bfloat16")
    for name, module in model.named_modules():
        if "norm" in name.lower() and hasattr(module, "weight"):
            module.float()  # fp32 norms over bf16 matrices, as some recipes keep them
    posttune.save_model(model, tmp_path / "mixed")
    assert json.loads((tmp_path / "mixed" / "config.json").read_text())["dtype"] == stored_dtype(tmp_path / "mixed")
    assert stored_dtype(tmp_path / "mixed") == "bfloat16"


def test_a_derived_generation_config_has_transformers_token_ids():
    tokens = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    theirs = transformers.GenerationConfig.from_model_config(transformers.LlamaConfig(**tokens))
    ours = generation_config_for(SimpleNamespace(generation_config=None), tokens)
    assert {key: ours.get(key) for key in tokens} == {key: getattr(theirs, key) for key in tokens}
