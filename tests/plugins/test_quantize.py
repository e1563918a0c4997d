"""`posttune quantize` (posttune-torchao) and the core's quantized-checkpoint loading.

The reference is transformers: it must load the export through its own torchao integration,
see quantized tensor subclasses, and greedy-decode the same tokens as `posttune generate`.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import posttune
import posttune_llama
import posttune_generate
import posttune_lora
import posttune_torchao
from posttune.adapters import merge_adapters, save_adapter
from posttune_lora.layer import apply_lora
from posttune.cli.main import build_parser
from posttune.descriptors import QuantizedFormat
from posttune.errors import PosttuneError
from posttune.plugins import module_plugin, new_plugin_set, set_plugins
from posttune.testing import run_cli
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
from posttune.tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

PROMPTS = ("Reverse: KERNEL", "hello there", "The quick brown fox")
NEW_TOKENS = 10


def _register(plugins):
    plugins.register(posttune_llama, name="llama", distribution="posttune-llama", version="0.1.0")
    plugins.register(posttune_torchao, name="torchao", distribution="posttune-torchao", version="0.1.0")
    plugins.register(posttune_lora, name="lora", distribution="posttune-lora", version="0.1.0")
    plugins.register(posttune_generate, name="generate", distribution="posttune-generate", version="0.1.0")


@pytest.fixture
def plugins(posttune_plugins):
    _register(posttune_plugins)
    return posttune_plugins


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny random Llama saved by posttune (with a tokenizer), and its int8 and int4 exports."""
    root = tmp_path_factory.mktemp("quantize")
    plugins = new_plugin_set()
    _register(plugins)
    previous = set_plugins(plugins)
    try:
        # vocabulary as large as the tiny tokenizer's; pad 3, not its BOS 0, so transformers' generate
        # does not take the BOS for padding
        save_tiny_hf_checkpoint(root / "hf", tiny_llama_config(vocab_size=384, pad_token_id=3))
        tokenizer = posttune.load_tokenizer(save_tiny_tokenizer(root / "tokenizer", template="llama3"))
        posttune.save_model(posttune.load_model(root / "hf"), root / "float", tokenizer=tokenizer)
        for scheme, extra in (("int8_weight_only", []), ("int4_weight_only", ["--group-size", "32"])):
            out = root / scheme
            done = run_cli("quantize", "--model", str(root / "float"), "--scheme", scheme, *extra,
                           "-o", str(out), "--device", "cpu")
            assert done.exit_code == 0, done.stderr
            assert f"wrote {scheme} export" in done.stdout
    finally:
        set_plugins(previous)
    return root


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def linear_weights(model):
    return {name: module.weight for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def token_ids(path, prompt):
    return posttune.load_tokenizer(path).encode(prompt)


@pytest.mark.parametrize(("scheme", "subclass"), [("int8_weight_only", "Int8Tensor"),
                                                  ("int4_weight_only", "IntxUnpackedToInt8Tensor")])
def test_transformers_loads_the_export_with_quantized_linear_weights(exports, scheme, subclass):
    model = hf_model(exports / scheme)
    assert model.config.quantization_config.quant_method == "torchao"
    weights = linear_weights(model)
    assert {type(w).__name__ for name, w in weights.items() if name != "lm_head"} == {subclass}
    assert type(weights.pop("lm_head")) is torch.nn.Parameter  # transformers' default: the head stays float
    assert len(weights) == 2 * 7
    # each linear weight is stored as one int8 per value plus its scales: under 30% of its fp32 bytes
    stored = load_file(exports / scheme / "model.safetensors")
    parts = {key: value for key, value in stored.items() if "._weight_" in key}
    assert {key.rpartition("._weight_")[0] for key in parts} == set(weights)
    assert not any(f"{name}.weight" in stored for name in weights)
    assert (sum(v.numel() * v.element_size() for v in parts.values())
            < 0.3 * sum(w.numel() * 4 for w in weights.values()))
    qdata = stored["model.layers.0.self_attn.q_proj._weight_qdata"]
    assert qdata.dtype == torch.int8
    assert qdata.min() >= (-8 if "int4" in scheme else -128) and qdata.max() <= (7 if "int4" in scheme else 127)
    assert len(qdata.unique()) > (12 if "int4" in scheme else 200)  # the whole grid is used
    saved = (exports / "float" / "model.safetensors").stat().st_size
    assert (exports / scheme / "model.safetensors").stat().st_size < 0.65 * saved
    tokenizer_files = {p.name for p in (exports / "float").iterdir()} - {"model.safetensors"}
    assert tokenizer_files <= {p.name for p in (exports / scheme).iterdir()}


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int4_weight_only"])
def test_posttune_generate_decodes_what_transformers_decodes(exports, scheme, plugins):
    out = exports / scheme
    model = hf_model(out)
    stops = posttune.load_tokenizer(out).eos_ids
    for prompt in PROMPTS:
        ids = token_ids(out, prompt)
        expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=stops)[0, len(ids):]
        assert len(expected) == NEW_TOKENS  # no early stop: every step is compared
        done = run_cli("generate", "--model", str(out), "--prompt", prompt, "--max-new-tokens", str(NEW_TOKENS),
                       "--show-ids", "--device", "cpu")
        assert done.exit_code == 0, done.stderr
        assert [int(t) for t in done.stdout.splitlines()[-1].split()] == expected.tolist(), prompt


@pytest.mark.parametrize(("scheme", "relative", "agree"), [("int8_weight_only", 0.02, 0.95),
                                                           ("int4_weight_only", 0.2, 0.75)])
def test_quantized_logits_stay_close_to_the_float_model(exports, plugins, scheme, relative, agree):
    """int8 per-row weights are near-lossless (under 2% of the logits' norm, almost every argmax
    kept); int4 in groups of 32 costs about ten times more on this random model."""
    ids = torch.randint(5, 380, (4, 24), generator=torch.Generator().manual_seed(0))
    reference = hf_model(exports / "float")(ids).logits
    quantized = posttune.load_model(exports / scheme)
    assert type(quantized.layers[0].attn.q_proj.weight).__name__ != "Parameter"
    logits = quantized(ids)
    with torch.no_grad():
        assert torch.allclose(logits, hf_model(exports / scheme)(ids).logits, atol=1e-5)  # both load the same
    error = ((logits - reference).norm() / reference.norm()).item()
    assert 1e-4 < error < relative  # quantized for real, yet close
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= agree


def test_an_adapter_is_merged_before_quantizing(exports, plugins, tmp_path):
    base = posttune.load_model(exports / "float")
    apply_lora(base, targets=["layers.*.attn.q_proj", "layers.*.mlp.down_proj"], rank=4, alpha=8.0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, param in base.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    save_adapter(base, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(exports / "float")  # --adapter alone finds its base
    done = run_cli("quantize", "--adapter", str(tmp_path / "adapter"), "-o", str(tmp_path / "int8"), "--device", "cpu")
    assert done.exit_code == 0, done.stderr
    ids = torch.randint(5, 380, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = base(ids)
        merge_adapters(base)
        assert torch.allclose(base(ids), adapted, atol=1e-5)
        plain = posttune.load_model(exports / "float")(ids)
        logits = hf_model(tmp_path / "int8")(ids).logits
    assert ((logits - adapted).norm() / adapted.norm()) < 0.02
    assert ((plain - adapted).norm() / adapted.norm()) > 0.1  # the adapter matters: merged, not dropped


@pytest.mark.parametrize(("argv", "message"), [
    (["--scheme", "int3_weight_only"], "--scheme 'int3_weight_only': expected one of int8_weight_only, "
                                       "int4_weight_only (did you mean 'int8_weight_only'?)"),
    (["--scheme", "int4"], "--scheme 'int4': expected one of int8_weight_only, int4_weight_only (did you mean "
                           "'int4_weight_only'?)"),  # a name cut short
    (["--scheme", "int4_weight_only", "--group-size", "48"],
     "--group-size 48 does not divide the 64 input features of 'model.layers.0.self_attn.q_proj'"),
    (["--group-size", "0"], "--group-size 0: expected a positive number of input features"),
    (["--device", "tpu"], "--device 'tpu' is not a device (auto, cpu, cuda, cuda:1 ...)"),
])
def test_bad_settings_are_refused_in_one_line(exports, plugins, tmp_path, argv, message):
    done = run_cli("quantize", "--model", str(exports / "float"), "-o", str(tmp_path / "out"), *argv)
    assert done.exit_code == 2
    assert done.stderr.strip() == f"posttune: error: quantize: {message}"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize(("argv", "config", "message"), [
    (["--scheme", "int3"], "{}", "quantize: --scheme 'int3': expected one of int8_weight_only, int4_weight_only"),
    (["--group-size", "0"], "{}", "quantize: --group-size 0: expected a positive number of input features"),
    ([], "{bad", "{model}/config.json: unreadable config.json: JSONDecodeError: Expecting property name enclosed "
                 "in double quotes: line 1 column 2 (char 1)"),
])
def test_what_is_refused_before_quantizing_is_refused_before_importing_torchao(tmp_path, argv, config, message):
    """torchao's import prints lines of its own (a kernel library it cannot load, deprecations): a bad argument or
    an unreadable checkpoint is refused before it, so the error is the one line printed. A fresh process: the
    installed plugins, torchao not imported yet."""
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    code = ("import sys\nfrom posttune.cli.main import main\nstatus = main(sys.argv[1:])\n"
            "print('torchao' in sys.modules, status)")
    done = subprocess.run([sys.executable, "-c", code, "quantize", "--model", str(model), "-o", str(tmp_path / "out"),
                           "--device", "cpu", *argv], capture_output=True, text=True, check=False)
    assert (done.stdout, done.stderr) == ("False 2\n", f"posttune: error: {message.format(model=model)}\n")


def test_missing_directories_and_outputs_in_use_are_refused(exports, plugins, tmp_path):
    cases = {
        ("--model", str(tmp_path / "nope")): f"--model {tmp_path / 'nope'}: no such directory",
        ("--adapter", str(exports / "float")): f"--adapter {exports / 'float'}: no adapter_config.json there",
        (): "give --model DIR (a saved checkpoint) or --adapter DIR (a PEFT adapter)",
    }
    for argv, message in cases.items():
        done = run_cli("quantize", *argv, "-o", str(tmp_path / "out"))
        assert (done.exit_code, done.stderr.strip()) == (2, f"posttune: error: quantize: {message}")
    done = run_cli("quantize", "--model", str(exports / "float"), "-o", str(exports / "float"))
    assert done.stderr.strip().endswith("exists and is not an empty directory; choose a new one")
    if not torch.cuda.is_available():
        done = run_cli("quantize", "--model", str(exports / "float"), "-o", str(tmp_path / "out"), "--device", "cuda")
        assert done.stderr.strip() == ("posttune: error: quantize: --device cuda: no CUDA device is available "
                                        "here (use cpu or auto)")


def test_a_quantized_checkpoint_is_for_inference_not_training(exports, plugins):
    from posttune.checkpoint.hf_load import load_into

    model = posttune.load_model(exports / "float")
    with pytest.raises(PosttuneError, match="'torchao'-quantized checkpoint is for inference .* train from the float"):
        load_into(model, exports / "int8_weight_only")


def test_help_describes_the_command_with_two_examples_that_parse(plugins, capsys):
    command = plugins.registry.get("command", "quantize")
    assert command.help and len(command.examples) == 2
    parser = build_parser()
    for example in command.examples:
        assert parser.parse_args(shlex.split(example)[1:]).command == "quantize"
    with pytest.raises(SystemExit):
        parser.parse_args(["quantize", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "default: int8_weight_only" in shown and "default: auto" in shown and "examples:" in shown


# ---- the core side: any plugin's QuantizedFormat, torchao aside -------------------------------------

def _toy_checkpoint(tmp_path, exports, method="toy"):
    """The float checkpoint, its weights stored negated and its config.json naming ``method``."""
    out = tmp_path / "toy"
    out.mkdir()
    tensors = {key: -value for key, value in load_file(exports / "float" / "model.safetensors").items()}
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((exports / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _read_negated(files, skip=()):
    for file in files:
        for key, value in load_file(file).items():
            if key not in skip:
                yield key, -value


def reference_rope(exports):
    return posttune.load_model(exports / "float").rope.inv_freq


def test_the_core_asks_the_format_the_checkpoint_names(exports, register_plugin, tmp_path):
    seen = []

    def read(files):
        seen.extend(files)
        return _read_negated(files)

    register_plugin(posttune_llama, distribution="posttune-llama")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(module_plugin("toy", posttune_register_quantized_formats=lambda register: register(
        QuantizedFormat("toy", read=read))))
    toy = _toy_checkpoint(tmp_path, exports)
    model = posttune.load_model(toy, dtype="bfloat16")
    assert seen == [toy / "model.safetensors"]
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad and not p.is_meta for p in model.parameters())
    assert torch.equal(model.rope.inv_freq, reference_rope(exports))  # non-persistent buffers recomputed
    ids = torch.randint(5, 380, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = posttune.load_model(exports / "float", dtype="bfloat16")
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_quantized_checkpoints_are_checked_like_any_other(exports, register_plugin, tmp_path):
    register_plugin(posttune_llama, distribution="posttune-llama")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(module_plugin("toy", posttune_register_quantized_formats=lambda register: register(
        QuantizedFormat("toy", read=lambda files: _read_negated(files, skip={"model.norm.weight"})))))
    with pytest.raises(PosttuneError, match=r"missing tensor 'model.norm.weight' \(native 'norm.weight'\): the "
                                            r"checkpoint does not provide it"):
        posttune.load_model(_toy_checkpoint(tmp_path, exports))
    with pytest.raises(PosttuneError, match="no quantized checkpoint format 'torchao' is installed .*"
                                            "pip install posttune-torchao"):
        posttune.load_model(exports / "int8_weight_only")


def test_a_model_with_tied_embeddings_is_exported_once_and_retied(exports, plugins, tmp_path):
    """The demo's shape: `tie_word_embeddings` (the head is the embedding). The export stores it once,
    as transformers' own save does, and both loaders tie it again."""
    save_tiny_hf_checkpoint(tmp_path / "hf",
                            tiny_llama_config(vocab_size=384, pad_token_id=3, tie_word_embeddings=True))
    posttune.save_model(posttune.load_model(tmp_path / "hf"), tmp_path / "float",
                        tokenizer=posttune.load_tokenizer(exports / "float"))
    done = run_cli("quantize", "--model", str(tmp_path / "float"), "-o", str(tmp_path / "int8"), "--device", "cpu")
    assert done.exit_code == 0, done.stderr
    assert "lm_head.weight" not in load_file(tmp_path / "int8" / "model.safetensors")
    theirs = hf_model(tmp_path / "int8")
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([token_ids(tmp_path / "int8", PROMPTS[0])])
    with torch.no_grad():
        torch.testing.assert_close(posttune.load_model(tmp_path / "int8")(ids), theirs(ids).logits, atol=1e-5, rtol=0)
