"""`posttune generate` on a saved checkpoint equals transformers' greedy `generate`, token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

import posttune_llama
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
from posttune.testing.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer


@pytest.fixture
def checkpoint(tmp_path, register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    save_tiny_tokenizer(tmp_path, template="llama3")
    tokenizer = load_tokenizer(tmp_path)
    config = tiny_llama_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                               eos_token_id=tokenizer.eos_ids)
    save_tiny_hf_checkpoint(tmp_path, config, seed=3)
    return tmp_path, tokenizer


def reference(path, ids, max_new_tokens, eos):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_generate_matches_transformers(checkpoint, posttune_cli, chat):
    path, tokenizer = checkpoint
    prompt = "The quick brown fox"
    ids = (tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
           if chat else tokenizer.encode(prompt))
    args = ["generate", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "16", "--show-ids"]
    result = posttune_cli(*args, *(["--chat"] if chat else []))
    assert result.exit_code == 0, result.stderr
    text, id_line = result.stdout.rstrip("\n").rsplit("\n", 1)
    ours = [int(i) for i in id_line.split()]
    assert ours == reference(path, ids, 16, tokenizer.eos_ids)
    assert text == tokenizer.decode(ours, skip_special_tokens=True)


def test_sampling_with_a_seed_is_reproducible(checkpoint, posttune_cli):
    path, _ = checkpoint
    args = ["generate", "--model", str(path), "--prompt", "hello", "--temperature", "1.0", "--top-k", "20",
            "--top-p", "0.9", "--seed", "7", "--max-new-tokens", "12", "--show-ids"]
    first, second = posttune_cli(*args), posttune_cli(*args)
    assert first.exit_code == 0, first.stderr
    assert first.stdout == second.stdout


def test_generate_on_a_folder_without_config_is_one_line(tmp_path, posttune_cli):
    result = posttune_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "config.json" in result.stderr
