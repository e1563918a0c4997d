"""A checkpoint's config.json is checked before anything is built from it.

A malformed value is one line naming the file and the field, exit status 2, from `posttune
validate`, `plan` and `train` alike (no traceback; `train` refuses before it claims the output
directory), for the policy and for every model role, with the family named or not. Every config
transformers writes for a causal language model still passes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import transformers
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from run_support import dpo_config, kd_config, sft_config

import posttune_dpo
import posttune_kd
import posttune_llama
import posttune_sft
from posttune.checkpoint.hf_config_check import COUNTS, check_hf_config
from posttune.checkpoint.source import read_hf_config
from posttune.errors import PosttuneError
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

#: (case, fields written over the tiny checkpoint's config.json, the error after "<file>: ")
BAD_VALUES = [
    ("negative", {"num_hidden_layers": -2}, "num_hidden_layers: expected a positive integer, got -2"),
    ("zero", {"hidden_size": 0}, "hidden_size: expected a positive integer, got 0"),
    ("string", {"vocab_size": "384"}, 'vocab_size: expected a positive integer, got "384"'),
    ("float", {"num_attention_heads": 4.5}, "num_attention_heads: expected a positive integer, got 4.5"),
    ("integral float", {"intermediate_size": 128.0},
     "intermediate_size: expected a positive integer (or a list of them, one per layer) or null, got 128.0"),
    ("bool", {"num_hidden_layers": True}, "num_hidden_layers: expected a positive integer, got true"),
    ("huge vocab", {"vocab_size": 10**12},
     "vocab_size: 1000000000000 is larger than any real model's (posttune accepts at most 4194304)"),
    ("huge layers", {"num_hidden_layers": 4097},
     "num_hidden_layers: 4097 is larger than any real model's (posttune accepts at most 4096)"),
    ("huge context", {"max_position_embeddings": 2**40},
     "max_position_embeddings: 1099511627776 is larger than any real model's (posttune accepts at most 67108864)"),
    ("null where required", {"hidden_size": None}, "hidden_size: expected a positive integer, got null"),
    ("negative optional", {"head_dim": -16}, "head_dim: expected an integer >= 0 or null, got -16"),
    ("zero kv heads", {"num_key_value_heads": 0}, "num_key_value_heads: expected a positive integer or null, got 0"),
    ("per-layer entry", {"intermediate_size": [128, -1]}, "intermediate_size[1]: expected a positive integer, got -1"),
    ("heads not dividing", {"num_key_value_heads": 3},
     "num_attention_heads: 4 is not a multiple of num_key_value_heads (3)"),
    ("eps string", {"rms_norm_eps": "1e-5"}, 'rms_norm_eps: expected a positive number or null, got "1e-5"'),
    ("eps negative", {"rms_norm_eps": -1e-5}, "rms_norm_eps: expected a positive number or null, got -1e-05"),
    ("theta NaN", {"rope_theta": math.nan}, "rope_theta: expected a positive number or null, got NaN"),
    ("theta infinite", {"rope_theta": math.inf}, "rope_theta: expected a positive number or null, got Infinity"),
    ("softcap zero", {"final_logit_softcapping": 0},
     "final_logit_softcapping: expected a positive number or null, got 0"),
    ("partial rotary", {"partial_rotary_factor": 2}, "partial_rotary_factor: expected a number in (0, 1], got 2"),
    ("no rotary", {"partial_rotary_factor": 0}, "partial_rotary_factor: expected a number in (0, 1], got 0"),
    ("boolean as string", {"tie_word_embeddings": "false"}, 'tie_word_embeddings: expected true or false, got "false"'),
    ("activation list", {"hidden_act": ["silu"]}, 'hidden_act: expected a string, got ["silu"]'),
    ("architectures string", {"architectures": "LlamaForCausalLM"},
     'architectures: expected a list of strings, got "LlamaForCausalLM"'),
    ("layer_types number", {"layer_types": 2}, "layer_types: expected a list of strings, got 2"),
    ("rope_scaling string", {"rope_scaling": "linear"},
     'rope_scaling: expected an object (a RoPE dict such as {"rope_type": "linear", "factor": 2.0}), got "linear"'),
    ("rope list", {"rope_parameters": [10000.0]},
     'rope_parameters: expected an object (a RoPE dict such as {"rope_type": "linear", "factor": 2.0}), '
     'got [10000.0]'),
    ("rope factor", {"rope_parameters": {"rope_type": "linear", "factor": -2.0}},
     "rope_parameters.factor: expected a positive number or null, got -2.0"),
    ("rope type list", {"rope_parameters": {"rope_type": ["yarn"]}},
     'rope_parameters.rope_type: expected a string, got ["yarn"]'),
    ("rope missing factor", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "rope_parameters.low_freq_factor: missing (rope_type 'llama3' needs it)"),
    ("longrope missing factors", {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
     "rope_scaling.long_factor: missing (rope_type 'longrope' needs it)"),
    ("longrope factor string", {"rope_scaling": {"type": "longrope", "short_factor": "1.0", "long_factor": [1.0]}},
     'rope_scaling.short_factor: expected a list of numbers, got "1.0"'),
    ("longrope factor zero", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 0]}},
     "rope_scaling.long_factor: expected a positive number or null, got 0"),
    ("rope per layer type", {"rope_parameters": {"full_attention": "default"}},
     'rope_parameters.full_attention: expected an object (a RoPE dict such as {"rope_type": "linear", '
     '"factor": 2.0}), got "default"'),
    ("rope original context", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": "4k"}},
     'rope_scaling.original_max_position_embeddings: expected a positive integer or null, got "4k"'),
    ("quantization string", {"quantization_config": "gptq"}, 'quantization_config: expected an object, got "gptq"'),
    ("quantization without method", {"quantization_config": {"bits": 4}},
     "quantization_config.quant_method: expected a non-empty string naming the quantization method, got null"),
    ("text_config string", {"text_config": "llama"}, 'text_config: expected an object, got "llama"'),
    ("text_config value", {"text_config": {"hidden_size": -64}},
     "text_config.hidden_size: expected a positive integer, got -64"),
]
#: (case, the whole of config.json, the error after "<file>: ")
BAD_FILES = [
    ("a list", "[1, 2]", "expected a JSON object of settings, got a list ([1, 2])"),
    ("a number", "3", "expected a JSON object of settings, got a number (3)"),
    ("a string", '"LlamaForCausalLM"', 'expected a JSON object of settings, got a string ("LlamaForCausalLM")'),
    ("null", "null", "expected a JSON object of settings, got null (null)"),
    ("broken JSON", '{"hidden_size": 64', "unreadable config.json: JSONDecodeError: "),
    ("5000 digits", '{"vocab_size": 1' + "0" * 5000 + "}", "unreadable config.json: ValueError: "),
    ("nested 100000 deep", "[" * 100_000, "unreadable config.json: RecursionError: "),
]
CASES = [pytest.param(edit, message, id=case) for case, edit, message in BAD_VALUES] + [
    pytest.param(text, message, id=case) for case, text, message in BAD_FILES]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama written by transformers (vocab 384, the demo tokenizer's; 4 heads over 2 key/value heads)."""
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_tiny_hf_checkpoint(path, tiny_llama_config(vocab_size=384))
    return path


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    """A copy of the tiny checkpoint for one test to spoil."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


@pytest.fixture
def plugins(register_plugin):
    for module in (posttune_llama, posttune_sft, posttune_dpo, posttune_kd):
        register_plugin(module, distribution=module.__name__.replace("_", "-"), version="0.1.0")


def spoil(checkpoint: Path, edit: dict | str) -> Path:
    """Write ``edit`` over the checkpoint's config.json (a dict: fields over its own; a str: the whole file)."""
    file = checkpoint / "config.json"
    text = edit if isinstance(edit, str) else json.dumps({**json.loads(file.read_text()), **edit})
    file.write_text(text)
    return file


def write_run(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def refused(result, file: Path, message: str) -> None:
    """Exit 2, nothing on stdout, and exactly one stderr line: the file, then the field and its problem."""
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"posttune: error: {file}: {message}"), result.stderr


# -- through the CLI ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["validate", "plan", "train"])
@pytest.mark.parametrize(("edit", "message"), CASES)
def test_a_malformed_config_json_is_one_line_naming_file_and_field(plugins, posttune_cli, checkpoint, tmp_path,
                                                                   command, edit, message):
    file = spoil(checkpoint, edit)
    config = sft_config(tmp_path)
    config["model"] = {"path": str(checkpoint)}
    result = posttune_cli(command, str(write_run(tmp_path, config)))
    refused(result, file, message)
    assert not Path(config["checkpoint"]["output_dir"]).exists()  # refused before the run claims its directory


@pytest.mark.parametrize("section", ["model", "reference", "reference with family", "teacher"])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_every_model_role_is_checked_family_named_or_not(plugins, posttune_cli, checkpoint, tmp_path, command,
                                                         section):
    """Before, a named family skipped config.json in validate; a role's checkpoint was read only to find its family."""
    file = spoil(checkpoint, {"num_hidden_layers": -2})
    if section == "model":
        config = sft_config(tmp_path)
        config["model"] = {"path": str(checkpoint), "family": "llama"}
    elif section == "teacher":
        config = kd_config(tmp_path, checkpoint)  # names the teacher's family
    else:
        named = {"family": "llama"} if section.endswith("family") else {}
        config = dpo_config(tmp_path, reference={"path": str(checkpoint), **named})
    result = posttune_cli(command, str(write_run(tmp_path, config)))
    refused(result, file, "num_hidden_layers: expected a positive integer, got -2")
    assert not Path(config["checkpoint"]["output_dir"]).exists()


def test_the_unspoiled_tiny_checkpoint_validates(plugins, posttune_cli, checkpoint, tmp_path):
    """The cases above fail for their edit, not for the run around them."""
    config = sft_config(tmp_path)
    config["model"] = {"path": str(checkpoint)}
    result = posttune_cli("validate", str(write_run(tmp_path, config)))
    assert result.exit_code == 0, result.stderr


def test_load_model_reads_through_the_same_check(checkpoint):
    import posttune

    file = spoil(checkpoint, {"rope_parameters": "yarn"})
    with pytest.raises(PosttuneError) as caught:
        posttune.load_model(checkpoint)
    assert str(caught.value).startswith(f"{file}: rope_parameters: expected an object")


def test_invalid_utf8_is_one_line(checkpoint):
    file = checkpoint / "config.json"
    file.write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(PosttuneError, match=r"unreadable config\.json: UnicodeDecodeError: "):
        read_hf_config(checkpoint)


# -- what passes ----------------------------------------------------------------------------------------------------

#: configs as transformers writes them: the families posttune ships, and others whose conventions the check must
#: allow (classes this transformers lacks are skipped; CONVENTIONS holds those spellings whatever the version)
TRANSFORMERS_CONFIGS = [
    "LlamaConfig", "MistralConfig", "MixtralConfig", "Qwen2Config", "Qwen3Config", "Qwen3MoeConfig", "Qwen2MoeConfig",
    "GemmaConfig", "Gemma2Config", "Gemma3TextConfig", "Gemma3Config", "Gemma3nTextConfig", "Gemma3nConfig",
    "Phi3Config", "GPTNeoConfig", "Cohere2MoeConfig", "Llama4Config", "DeepseekV3Config",
]
ROPE = [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0,
     "original_max_position_embeddings": 4096},
    {"rope_type": "dynamic", "factor": 2.0},
    {"type": "longrope", "long_factor": [1.0, 1.5], "short_factor": [1.0, 1.0]},
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
]


#: spellings that mean "absent" or "per layer" in some released config.json, not a malformed value
CONVENTIONS = {
    "per-layer MLP widths (Gemma 3n)": {"intermediate_size": [8192, 8192, 16384]},
    "null MLP width: 4 x hidden_size (GPT-Neo)": {"intermediate_size": None},
    "null rms_norm_eps: a LayerNorm (Cohere 2)": {"rms_norm_eps": None},
    "window 0: none (Qwen2-MoE, transformers 5)": {"sliding_window": 0, "use_sliding_window": False},
    "head_dim 0: derived": {"head_dim": 0},
    "nulls for optional sizes": {"head_dim": None, "num_key_value_heads": None, "max_position_embeddings": None,
                                 "sliding_window": None, "rope_scaling": None, "quantization_config": None},
    "bidirectional attention named, not a boolean (Gemma 4)": {"use_bidirectional_attention": "vision"},
    "RoPE per layer type (Gemma 3, transformers 5)": {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "multimodal text_config": {"text_config": {"hidden_size": 2560, "num_attention_heads": 8}},
    "quantized": {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
}


@pytest.mark.parametrize("name", TRANSFORMERS_CONFIGS)
def test_configs_transformers_writes_pass(name):
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config = json.loads(getattr(transformers, name)().to_json_string(use_diff=False))
    assert check_hf_config(config, name) is config


@pytest.mark.parametrize("fields", list(CONVENTIONS.values()), ids=list(CONVENTIONS))
def test_released_conventions_pass(fields):
    config = {**tiny_llama_config().to_dict(), **fields}
    assert check_hf_config(config, "config.json") is config


@pytest.mark.parametrize("rope", ROPE, ids=lambda rope: rope.get("rope_type") or rope["type"])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_released_rope_dicts_pass(key, rope):
    config = {**tiny_llama_config().to_dict(), key: rope}
    assert check_hf_config(config, "config.json") is config


def test_the_tiny_checkpoint_reads_unchanged(checkpoint):
    assert read_hf_config(checkpoint) == json.loads((checkpoint / "config.json").read_text())


CEILINGS = {name: count.high for name, count in COUNTS.items() if count.high < 2**31 - 1}


@pytest.mark.parametrize("name", sorted(CEILINGS))
def test_each_ceiling_is_allowed_and_one_more_is_not(name):
    assert check_hf_config({name: CEILINGS[name]}, "config.json")
    with pytest.raises(PosttuneError) as caught:
        check_hf_config({name: CEILINGS[name] + 1}, "config.json")
    assert str(caught.value) == (f"config.json: {name}: {CEILINGS[name] + 1} is larger than any real model's "
                                 f"(posttune accepts at most {CEILINGS[name]})")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from([*COUNTS, "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "rope_type",
                         "factor", "full_attention", "quantization_config", "quant_method", "text_config",
                         "architectures", "layer_types", "partial_rotary_factor", "hidden_act", "x"]),
        inner, max_size=6),
    max_leaves=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(config=JSON)
def test_any_json_is_accepted_or_one_line(config):
    """Whatever config.json parses to, the check returns it or raises one PosttuneError line naming the file."""
    try:
        assert check_hf_config(config, "config.json") is config
    except PosttuneError as exc:
        assert str(exc).startswith("config.json: ") and "\n" not in str(exc)
