"""`posttune merge` writes what PEFT's own ``merge_and_unload`` gives, as a plain HF checkpoint."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

import posttune_llama
import posttune_generate
import posttune_lora
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer


@pytest.fixture
def base(tmp_path_factory, register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    path = tmp_path_factory.mktemp("base")
    save_tiny_tokenizer(path, template="llama3")
    tokenizer = load_tokenizer(path)
    save_tiny_hf_checkpoint(path, tiny_llama_config(vocab_size=tokenizer.vocab_size), seed=3)
    return path


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def saved_adapter(base, folder, use_dora: bool, dtype: torch.dtype = torch.float32):
    """A PEFT adapter with non-zero updates (``init_lora_weights=False``) on attention and MLP layers; bf16: as
    a bf16 run (whose adapters train in the base's dtype) saves it."""
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, use_dora=use_dora)
    peft.get_peft_model(hf_model(base), config).to(dtype).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merged_checkpoint_equals_peft_merge_and_unload(base, posttune_cli, tmp_path, use_dora):
    adapter = saved_adapter(base, tmp_path / "adapter", use_dora)
    result = posttune_cli("merge", "--adapter", str(adapter), "-o", str(tmp_path / "merged"))
    assert result.exit_code == 0, result.stderr
    assert f"({2 * 3} adapted layers)" in result.stdout and str(tmp_path / "merged") in result.stdout

    theirs = peft.PeftModel.from_pretrained(hf_model(base), adapter).merge_and_unload().eval()
    ours = hf_model(tmp_path / "merged")  # a plain checkpoint: no adapter_config.json, no lora tensors
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(ours(ids).logits, hf_model(base)(ids).logits, atol=1e-3)  # the adapter mattered
    assert load_tokenizer(tmp_path / "merged").encode("hello") == load_tokenizer(base).encode("hello")


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16], ids=["fp32-adapter", "bf16-adapter"])
@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_bf16_merge_is_bitwise_peft_merge_and_unload(base, posttune_cli, tmp_path, use_dora, saved):
    """On a base stored in bf16: loaded as fp32 adapters on it, the update computed and added in fp32 and rounded
    once, as PEFT does (1 ulp apart on ~30-50% of the adapted weights when adapters or update were rounded to bf16
    first). An fp32 base with ``--dtype bf16`` is merged in fp32 and rounded once after: PEFT's merge of it, cast
    (the base was cast first before, and 22% of the merged weights were 1 ulp from the sum's rounding)."""
    adapter = saved_adapter(base, tmp_path / "adapter", use_dora, saved)
    stored = tmp_path / "bf16-base"
    transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(stored)
    def fp32_merge(checkpoint, dtype):  # PEFT's merge of the checkpoint's weights in fp32, rounded once
        return {name: tensor.to(dtype) for name, tensor in peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), adapter)
            .merge_and_unload().state_dict().items()}

    references = {
        "stored": peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
            stored, dtype=torch.bfloat16), adapter).merge_and_unload().state_dict(),
        "cast": fp32_merge(base, torch.bfloat16),
        # as wide as bf16 but another format: rounded once too (merging in bf16 first lost fp16's precision)
        "across": fp32_merge(stored, torch.float16),
    }
    for case, options in (("stored", ["--model", str(stored)]), ("cast", ["--dtype", "bf16"]),
                          ("across", ["--model", str(stored), "--dtype", "fp16"])):
        out = tmp_path / f"merged-{case}"
        result = posttune_cli("merge", "--adapter", str(adapter), *options, "-o", str(out))
        assert result.exit_code == 0, result.stderr
        ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=None).state_dict()
        assert [name for name, tensor in references[case].items() if not torch.equal(ours[name], tensor)] == []
    plain = transformers.AutoModelForCausalLM.from_pretrained(stored, dtype=torch.bfloat16).state_dict()
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"],
                           plain["model.layers.0.self_attn.q_proj.weight"])  # the adapter mattered


def test_a_merge_s_dtype_typo_names_the_option(base, posttune_cli, tmp_path):
    result = posttune_cli("merge", "--adapter", str(tmp_path), "--dtype", "bfloat", "-o", str(tmp_path / "merged"))
    assert result.exit_code == 2
    assert result.stderr.endswith("posttune merge: error: argument --dtype: expected a floating-point dtype such as "
                                  "bf16, bfloat16, fp16 or fp32, got 'bfloat'\n")


def test_model_overrides_the_base_the_adapter_names(base, posttune_cli, tmp_path):
    adapter = saved_adapter(base, tmp_path / "adapter", use_dora=False)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved-away")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    result = posttune_cli("merge", "--adapter", str(adapter), "--model", str(base), "--dtype", "bf16",
                          "-o", str(tmp_path / "merged"))
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    assert "warning" not in result.stderr  # the base it names is not here: nothing to compare


def test_merging_into_another_base_than_the_adapter_names_warns(base, posttune_cli, tmp_path):
    """An adapter trained on one checkpoint merged into another of the same shapes: allowed, as PEFT allows it,
    but said (a TRL user's adapter of an SFT'd model went silently into the untrained one)."""
    adapter = saved_adapter(base, tmp_path / "adapter", use_dora=False)
    other = tmp_path / "other"
    save_tiny_tokenizer(other, template="llama3")
    save_tiny_hf_checkpoint(other, tiny_llama_config(vocab_size=load_tokenizer(other).vocab_size), seed=4)
    result = posttune_cli("merge", "--adapter", str(adapter), "--model", str(other), "-o", str(tmp_path / "merged"))
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (f"merge: warning: {adapter} was trained on {base}, not on --model {other}; the merged "
                             "model is that base plus this update\n")
    same = posttune_cli("merge", "--adapter", str(adapter), "--model", str(base), "-o", str(tmp_path / "again"))
    assert same.exit_code == 0 and same.stderr == ""


@pytest.mark.parametrize(("case", "words"), [
    ("no-adapter-config", "no adapter_config.json there"),
    ("output-not-empty", "exists and is not an empty directory"),
])
def test_bad_input_is_one_line_and_writes_nothing(base, posttune_cli, tmp_path, case, words):
    adapter = saved_adapter(base, tmp_path / "adapter", use_dora=False)
    out = tmp_path / "merged"
    if case == "no-adapter-config":
        adapter = tmp_path
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    result = posttune_cli("merge", "--adapter", str(adapter), "-o", str(out))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and words in result.stderr and "merge" in result.stderr
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == ["keep.txt"]
