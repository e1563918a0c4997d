"""The HF checkpoint format and the public load/save API, through a family defined in this file.

The test family ("wrapped") wraps transformers' own LlamaForCausalLM, and its converter
renames every tensor ``KEY`` <-> ``inner.KEY``: the generic machinery (config.json, shards,
meta build, streaming, tied weights, checks, atomic save) is tested without any family
plugin, and logits can be compared with transformers exactly. tests/models covers llama.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

import posttune
from posttune.checkpoint import hf_save
from posttune.checkpoint.convert import Join
from posttune.descriptors import CheckpointConverter, ModelFamily
from posttune.errors import PosttuneError
from posttune.plugins import module_plugin
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

IDS = torch.tensor([[1, 5, 9, 200, 3, 77, 4, 8]])
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")


class Wrapped(nn.Module):
    """A "native" model: transformers' Llama under ``inner``, returning logits."""

    def __init__(self, **config):
        super().__init__()
        self.inner = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))

    def forward(self, input_ids):
        return self.inner(input_ids).logits

    def init_buffers(self):
        rotary = self.inner.model.rotary_emb
        inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)


def to_hf_config(kwargs):
    return {**transformers.LlamaConfig(**kwargs).to_dict(), "architectures": ["LlamaForCausalLM"]}


WRAPPED = ModelFamily(
    name="wrapped", architectures=("LlamaForCausalLM",), build=Wrapped, to_hf_config=to_hf_config,
    from_hf_config=lambda cfg: {k: cfg[k] for k in FIELDS if k in cfg},
    sizes={"debug": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2}},
)
CONVERTER = CheckpointConverter(
    family="wrapped", format="hf",
    to_native=lambda key, tensor, cfg: (f"inner.{key}", tensor),
    from_native=lambda key, tensor, cfg: (key.removeprefix("inner."), tensor),
)


@pytest.fixture(autouse=True)
def wrapped_family(register_plugin):
    register_plugin(module_plugin(
        "wrapped_family",
        posttune_register_model_families=lambda register: register(WRAPPED),
        posttune_register_checkpoint_converters=lambda register: register(CONVERTER),
    ))


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny transformers checkpoint (single file) and the model that wrote it."""
    path = tmp_path / "hf"
    return path, save_tiny_hf_checkpoint(path, tiny_llama_config())


def hf_logits(path_or_model) -> torch.Tensor:
    model = path_or_model
    if not isinstance(model, nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def our_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).float()


def assert_close(a, b):
    assert (a - b).abs().max().item() <= 1e-4


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(PosttuneError) as error:
        fn(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


# -- loading ---------------------------------------------------------------------------------------

def test_sharded_transformers_checkpoint_loads_with_transformers_logits(tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path, tiny_llama_config(), max_shard_size="100KB")
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = posttune.load_model(tmp_path)
    assert_close(our_logits(model), hf_logits(reference))
    assert not model.training


def test_tied_embeddings_stay_tied_after_loading(tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path, tiny_llama_config(tie_word_embeddings=True))
    model = posttune.load_model(tmp_path)
    assert model.inner.lm_head.weight is model.inner.model.embed_tokens.weight
    assert_close(our_logits(model), hf_logits(reference))


def test_a_tied_weight_stored_twice_loads_when_equal_and_is_refused_when_not(tmp_path):
    """A head trained apart from the embedding in a config still tied: transformers unties them; taking either
    would lose the other's training, so posttune names both tensors and the config key to change."""
    reference = save_tiny_hf_checkpoint(tmp_path, tiny_llama_config(tie_word_embeddings=True))
    rewrite(tmp_path, lambda tensors: tensors.update({"lm_head.weight": tensors["model.embed_tokens.weight"].clone()}))
    assert_close(our_logits(posttune.load_model(tmp_path)), hf_logits(reference))  # equal copies: one weight
    rewrite(tmp_path, lambda tensors: tensors.update({"lm_head.weight": tensors["lm_head.weight"] + 1}))
    message = error_of(posttune.load_model, tmp_path)
    assert message.startswith(f"{tmp_path}: the checkpoint holds '") and "with different values" in message
    assert "'lm_head.weight'" in message and "'model.embed_tokens.weight'" in message
    assert message.endswith("(config.json's tie_word_embeddings): set it to false in config.json to load both, "
                            "as transformers does")


def test_a_single_weights_file_wins_over_a_stale_index_beside_it(tmp_path):
    """transformers reads model.safetensors first: an index (and shards) left from an older save must not win,
    nor a stray index whose shards are gone."""
    save_tiny_hf_checkpoint(tmp_path / "old", tiny_llama_config(), max_shard_size="100KB")
    reference = save_tiny_hf_checkpoint(tmp_path / "new", tiny_llama_config(), seed=1)
    stale = sorted((tmp_path / "old").glob("model*.safetensors*"))
    for path in stale:
        path.rename(tmp_path / "new" / path.name)
    assert len(stale) > 2 and (tmp_path / "new" / "model.safetensors.index.json").is_file()
    assert_close(our_logits(posttune.load_model(tmp_path / "new")), hf_logits(reference))
    for path in (tmp_path / "new").glob("model-*.safetensors"):
        path.unlink()
    assert_close(our_logits(posttune.load_model(tmp_path / "new")), hf_logits(reference))


def test_dtype_defaults_to_the_checkpoints_own(checkpoint, tmp_path):
    path, reference = checkpoint
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert posttune.load_model(tmp_path / "bf16").inner.lm_head.weight.dtype == torch.bfloat16
    assert posttune.load_model(tmp_path / "bf16", dtype="float32").inner.lm_head.weight.dtype == torch.float32
    assert posttune.load_model(path, dtype=torch.bfloat16).inner.lm_head.weight.dtype == torch.bfloat16


def test_dtype_defaults_to_float32_when_the_config_names_none(checkpoint):
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    assert posttune.load_model(path).inner.lm_head.weight.dtype == torch.float32


def test_family_can_be_named_instead_of_found(checkpoint):
    path, _ = checkpoint
    assert posttune.load_model(path, family="wrapped").posttune_origin.family == "wrapped"


# -- saving ----------------------------------------------------------------------------------------

def test_saved_checkpoint_loads_in_transformers_with_the_same_logits(checkpoint, tmp_path):
    path, reference = checkpoint
    model = posttune.load_model(path)
    posttune.save_model(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert_close(hf_logits(tmp_path / "out"), hf_logits(reference))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["pad_token_id"] == 0 and saved["dtype"] == "float32"


def test_own_sharded_save_reloads_in_posttune_and_transformers(checkpoint, tmp_path):
    path, reference = checkpoint
    posttune.save_model(posttune.load_model(path), tmp_path / "out", max_shard_size="60KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards for t in load_file(tmp_path / "out" / s).values())
    assert_close(our_logits(posttune.load_model(tmp_path / "out")), hf_logits(reference))
    assert_close(hf_logits(tmp_path / "out"), hf_logits(reference))


def test_tied_weight_is_saved_once_and_transformers_reties_it(tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", tiny_llama_config(tie_word_embeddings=True))
    posttune.save_model(posttune.load_model(tmp_path / "hf"), tmp_path / "out")
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    assert_close(hf_logits(tmp_path / "out"), hf_logits(reference))


def test_bf16_save_records_the_dtype_in_config_json(checkpoint, tmp_path):
    path, _ = checkpoint
    posttune.save_model(posttune.load_model(path, dtype="bfloat16"), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight.dtype == torch.bfloat16


def test_built_model_saves_config_from_the_family(tmp_path):
    model = posttune.build_model("wrapped", "debug", num_hidden_layers=1)
    assert len(model.inner.model.layers) == 1
    posttune.save_model(model, tmp_path / "out")
    assert_close(hf_logits(tmp_path / "out"), our_logits(model))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 1


def test_tokenizer_files_are_saved_with_the_model(checkpoint, tmp_path):
    class Tokenizer:
        def save(self, out_dir):
            (Path(out_dir) / "tokenizer.json").write_text("{}")

    path, _ = checkpoint
    posttune.save_model(posttune.load_model(path), tmp_path / "out", tokenizer=Tokenizer())
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"


def test_origin_survives_deepcopy(checkpoint):
    model = posttune.load_model(checkpoint[0])
    assert copy.deepcopy(model).posttune_origin == model.posttune_origin


def test_failed_save_leaves_the_previous_checkpoint_and_no_temp_dir(checkpoint, tmp_path, monkeypatch):
    model = posttune.load_model(checkpoint[0])
    out = tmp_path / "out"
    posttune.save_model(model, out, max_shard_size="60KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = hf_save.write_file, []

    def crash_on_second_shard(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"half a shard")
            raise OSError("disk full")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hf_save, "write_file", crash_on_second_shard)
    with torch.no_grad():
        model.inner.lm_head.weight.zero_()
    with pytest.raises(OSError, match="disk full"):
        posttune.save_model(model, out, max_shard_size="60KB")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


def test_save_replaces_a_previous_checkpoint(checkpoint, tmp_path):
    out = tmp_path / "out"
    model = posttune.load_model(checkpoint[0])
    posttune.save_model(model, out, max_shard_size="60KB")
    posttune.save_model(model, out)
    assert not (out / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


# -- errors: one line each, naming what is wrong ---------------------------------------------------

def test_folder_without_config_json(tmp_path):
    assert error_of(posttune.load_model, tmp_path) == f"{tmp_path}: not a Hugging Face checkpoint (no config.json)"


def test_missing_directory(tmp_path):
    assert error_of(posttune.load_model, tmp_path / "nope").endswith("no such checkpoint directory")


def test_a_weights_file_is_named_as_a_file(tmp_path):
    """torchtune's checkpointer names weight files; a model path names the folder, and says so."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert error_of(posttune.load_model, tmp_path / "model.safetensors") == (
        f"{tmp_path / 'model.safetensors'}: is a file; give the checkpoint folder that holds config.json and the "
        "weights")


def test_architecture_no_installed_family_reads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert error_of(posttune.load_model, tmp_path) == (
        f"{tmp_path}: no installed model family reads architecture Qwen3ForCausalLM "
        "(installed: wrapped (LlamaForCausalLM)) — pip install posttune-qwen")


def test_a_config_naming_no_architecture_asks_for_the_family(checkpoint):
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    assert error_of(posttune.load_model, path) == (
        f"{path}: config.json names no architectures: name the family to read it with (model.family in a config, "
        "family= in Python, or add architectures to config.json; installed: wrapped)")
    assert posttune.load_model(path, family="wrapped") is not None


def test_a_quantization_no_plugin_reads_says_to_load_the_float_checkpoint(checkpoint):
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    assert error_of(posttune.load_model, path) == (
        f"{path}: config.json's quantization_config: no quantized checkpoint format 'gptq' is installed (installed: "
        "none); or load the float checkpoint it was made from (QLoRA quantizes one itself: docs/memory.md)")


def test_missing_shard_is_named(tmp_path):
    save_tiny_hf_checkpoint(tmp_path, tiny_llama_config(), max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert error_of(posttune.load_model, tmp_path) == (
        f"{tmp_path}: shard {shard.name} listed in model.safetensors.index.json is missing")


def test_no_weights_at_all(checkpoint):
    path, _ = checkpoint
    (path / "model.safetensors").unlink()
    assert "no model.safetensors or model.safetensors.index.json" in error_of(posttune.load_model, path)


def test_wrong_shape_names_the_tensor_and_both_shapes(checkpoint):
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert error_of(posttune.load_model, path) == (
        f"{path}: tensor 'model.layers.0.mlp.down_proj.weight' (native 'inner.model.layers.0.mlp.down_proj.weight') "
        "in model.safetensors has shape [64, 128]; the model expects [64, 96]")


def rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint):
    path, _ = checkpoint
    rewrite(path, lambda tensors: tensors.pop("model.norm.weight"))
    assert error_of(posttune.load_model, path) == (
        f"{path}: missing tensor 'model.norm.weight' (native 'inner.model.norm.weight'): "
        "the checkpoint does not provide it")


def test_unexpected_tensor_is_named(checkpoint):
    path, _ = checkpoint
    rewrite(path, lambda tensors: tensors.update({"model.extra.weight": torch.zeros(2)}))
    assert error_of(posttune.load_model, path) == (
        f"{path}: unexpected tensor 'model.extra.weight' (native 'inner.model.extra.weight') in the checkpoint: "
        "the model has no such weight")


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(checkpoint, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    message = error_of(posttune.save_model, posttune.load_model(checkpoint[0]), tmp_path / "home")
    assert "refusing to replace a non-empty directory" in message
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep me"


def test_unknown_size_lists_the_sizes():
    assert error_of(posttune.build_model, "wrapped", "debg") == (
        "model family 'wrapped' has no size 'debg' (sizes: debug) (did you mean 'debug'?)")


def test_saving_a_model_posttune_did_not_build():
    assert "not a posttune model" in error_of(posttune.save_model, nn.Linear(2, 2), "unused")


# -- import cost -----------------------------------------------------------------------------------

def test_importing_posttune_does_not_import_torch():
    code = "import sys, posttune, posttune.checkpoint, posttune.plan; assert 'torch' not in sys.modules; " \
           "print(callable(posttune.load_model))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


def test_tensors_are_checked_while_streaming_when_the_converter_cannot_run_on_meta(checkpoint, monkeypatch):
    from posttune.checkpoint import hf_load

    def real_tensors_only(key, tensor, cfg):
        if tensor.is_meta:
            raise NotImplementedError("needs data")
        return f"inner.{key}", tensor

    monkeypatch.setattr(hf_load._Loader, "_joiner", lambda self: hf_load.Joiner(real_tensors_only, {}))
    path, reference = checkpoint
    assert_close(our_logits(posttune.load_model(path)), hf_logits(reference))
    rewrite(path, lambda tensors: tensors.update({"model.extra.weight": torch.zeros(2)}))
    assert error_of(posttune.load_model, path) == (
        f"{path}: unexpected tensor 'model.extra.weight' (native 'inner.model.extra.weight') in "
        "model.safetensors: the model has no such weight")
    rewrite(path, lambda tensors: [tensors.pop("model.extra.weight"), tensors.pop("model.norm.weight")])
    assert "missing tensor 'model.norm.weight'" in error_of(posttune.load_model, path)


def test_unreachable_hub_id_is_one_line():
    # tests run with HF_HUB_OFFLINE=1 (tests/conftest.py): the hub call fails at once
    assert error_of(posttune.load_model, "nobody/nothing").startswith(
        "nobody/nothing: cannot fetch config.json from the hub: ")


@pytest.mark.parametrize("size, expected", [(1000, 1000), ("5GB", 5 * 10**9), ("500MiB", 500 * 2**20),
                                            ("1.5 kb", 1500)])
def test_shard_sizes_read_like_transformers(size, expected):
    assert hf_save.parse_size(size) == expected


def test_bad_shard_size_is_one_line(checkpoint):
    model = posttune.load_model(checkpoint[0])
    assert error_of(posttune.save_model, model, "unused", max_shard_size="lots") == (
        "max_shard_size: expected bytes or a size like '5GB', got 'lots'")


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_load_into_fills_the_base_of_an_adapted_model(checkpoint, kind):
    from posttune.adapters import init_adapters
    from posttune_lora.layer import apply_lora
    from posttune.checkpoint import materialize as mat
    from posttune.checkpoint.hf_load import load_into

    path, reference = checkpoint
    model = mat.build(Wrapped, WRAPPED.from_hf_config(reference.config.to_dict()), torch.float32, "meta")
    apply_lora(model, targets=["q_proj", "v_proj"], rank=2, alpha=4, kind=kind)
    mat.materialize(model, "cpu")
    load_into(model, path)
    model.init_buffers()
    init_adapters(model)  # lora_B starts at zero: the adapted model computes the base model
    assert_close(our_logits(model), hf_logits(reference))


def test_a_dtensor_parameter_receives_its_shard(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from posttune.checkpoint.materialize import copy_into as _copy_into

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
        _copy_into(param, torch.arange(8.0).reshape(4, 2))
        assert torch.equal(param.full_tensor(), torch.arange(8.0).reshape(4, 2))
    finally:
        dist.destroy_process_group()


def test_a_converters_split_is_made_one_part_at_a_time_and_a_join_held_only_until_complete():
    """The contract of posttune.checkpoint.convert, which load and save both stream through."""
    from posttune.checkpoint.convert import Joiner

    made = []

    def convert(key, tensor, config):
        if key == "fused":  # one-to-many, as a generator
            return ((name, made.append(name) or part) for name, part in zip("ab", tensor.split(1), strict=True))
        return Join("whole", ("x", "y"), join=torch.cat), tensor  # many-to-one

    joiner = Joiner(convert, {})
    split = joiner("fused", torch.tensor([1.0, 2.0]))
    assert made == []
    assert next(split)[:2] == ("fused", "a") and made == ["a"]
    assert list(joiner("y", torch.tensor([4.0]))) == [] and list(joiner.held) == ["whole"]
    [(source, key, value)] = joiner("x", torch.tensor([3.0]))
    assert (source, key, value.tolist(), joiner.held) == ("x", "whole", [3.0, 4.0], {})  # in the parts' order


@pytest.mark.parametrize(("answer", "message"), [
    (lambda t: t, "converter: 'x' became Tensor, not a (key, tensor) pair"),
    (lambda t: (Join("whole", ("a", "b"), join=torch.cat), t), "converter: 'x' is not one of the parts of 'whole' "
                                                                 "it joins ('a', 'b')"),
])
def test_a_converter_answer_outside_the_contract_is_one_line(answer, message):
    from posttune.checkpoint.convert import Joiner

    with pytest.raises(PosttuneError) as caught:
        list(Joiner(lambda key, tensor, config: answer(tensor), {})("x", torch.zeros(2)))
    assert str(caught.value) == message


def _header_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(("header", "problem"), [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2],
                                                                        "data_offsets": [4, 12]}},
     "corrupt safetensors header: tensors 'a' and 'b' overlap"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
     "corrupt safetensors header: tensor 'a' has offsets [-8, 0] and shape [2]"),
    ({"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}},
     "corrupt safetensors header: tensor 'a' has offsets [0, 8] and shape [-2, -1]"),
])
def test_a_crafted_safetensors_header_is_refused(tmp_path, header, problem):
    """Overlapping tensors and negative offsets loaded silently (bytes of the header read as weights); a negative
    shape was a raw RuntimeError."""
    from posttune.checkpoint.safetensors_io import read_header

    path = _header_file(tmp_path / "model.safetensors", header, b"\0" * 16)
    with pytest.raises(PosttuneError) as caught:
        read_header(path)
    assert str(caught.value) == f"{path}: {problem}"
    fine = _header_file(tmp_path / "fine.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
                        b"\0" * 16)
    assert [entry.name for entry in read_header(fine)] == ["a", "b"]
