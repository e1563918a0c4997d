"""A tokenizer with ids past the policy's embedding (tokens added without resizing it) is refused in one line:
by `validate` from the local files, at build time for a model `validate` cannot read (a hub id), and by
`posttune generate`; before, the first forward stopped with a raw IndexError (a device-side assert on a GPU)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from run_support import TOKENIZER, sft_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
from posttune.errors import PosttuneError
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
from posttune.tokenizer import check_fits, load_tokenizer

TOO_MANY = ("the tokenizer has 384 token ids and the model's embedding 256 rows: ids 256 and up (tokens added "
            "without resizing the embeddings?) would index past it; use the model's own tokenizer")


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def small_checkpoint(path):
    """A tiny Llama of 256 ids beside the demo's tokenizer of 384."""
    save_tiny_hf_checkpoint(path, tiny_llama_config(vocab_size=256))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TOKENIZER}/{name}", path / name)
    return path


def test_validate_refuses_a_named_size_smaller_than_the_tokenizer(plugins, posttune_cli, tmp_path):
    config = sft_config(tmp_path, model={"build_overrides": {"vocab_size": 256}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(tmp_path / "run.yaml"))
    assert (result.exit_code, result.stderr) == (
        2, f"posttune: error: config: tokenizer.path: {TOKENIZER}: {TOO_MANY}\n")
    config["model"]["build_overrides"]["vocab_size"] = 384  # as many rows as ids: fine (more would be too)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert posttune_cli("validate", str(tmp_path / "run.yaml")).exit_code == 0


def test_validate_refuses_a_checkpoint_whose_folder_holds_a_larger_tokenizer(plugins, posttune_cli, tmp_path):
    config = sft_config(tmp_path)
    config["model"] = {"path": str(small_checkpoint(tmp_path / "small"))}
    del config["tokenizer"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(tmp_path / "run.yaml"))
    assert (result.exit_code, result.stderr) == (2, f"posttune: error: config: model.path: {tmp_path / 'small'}: "
                                                    f"{TOO_MANY}\n")


def test_the_build_time_check_reads_the_models_embedding(tmp_path):
    from posttune_llama.model import build
    from posttune_llama.sizes import LLAMA_SIZES

    tokenizer = load_tokenizer(TOKENIZER)
    with pytest.raises(PosttuneError) as refused:
        check_fits(tokenizer, build(**{**LLAMA_SIZES["tiny"], "vocab_size": 256}), "model")
    assert str(refused.value) == f"model: {TOO_MANY}"
    check_fits(tokenizer, build(**{**LLAMA_SIZES["tiny"], "vocab_size": 384}), "model")
    check_fits(tokenizer, object(), "model")  # no native embedding: nothing to read


def test_generate_refuses_it_in_one_line(plugins, posttune_cli, tmp_path):
    small = small_checkpoint(tmp_path / "small")
    result = posttune_cli("generate", "--model", str(small), "--prompt", "Reverse: ABC")
    assert (result.exit_code, result.stderr) == (2, f"posttune: error: --model: {TOO_MANY}\n")


def test_validate_counts_the_tokens_tokenizer_config_adds(plugins, posttune_cli, tmp_path):
    """Tokens that tokenizer_config.json names and tokenizer.json lacks get ids on load (as transformers adds them):
    validate read tokenizer.json alone, said valid, and training refused at build time."""
    import json

    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    decoder = config.get("added_tokens_decoder") or {}
    for index, text in enumerate(["<think>", "</think>"]):  # new tokens, and one the file already has
        decoder[str(384 + index)] = {"content": text, "special": False}
    config["added_tokens_decoder"] = decoder
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(folder).vocab_size == 386
    run = sft_config(tmp_path, tokenizer={"path": str(folder)}, model={"build_overrides": {"vocab_size": 384}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    result = posttune_cli("validate", str(tmp_path / "run.yaml"))
    assert result.exit_code == 2 and "the tokenizer has 386 token ids and the model's embedding 384 rows" in \
        result.stderr, result.stderr
