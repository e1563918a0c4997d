"""`posttune generate` on a saved checkpoint equals transformers' greedy `generate`, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import posttune_llama
import posttune_generate
import posttune_lora
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer


@pytest.fixture(autouse=True)
def generate_command(register_plugin):
    """`posttune generate` is posttune-generate's command."""
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.fixture
def checkpoint(tmp_path, register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
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


def test_a_folder_that_is_no_language_model_is_named_with_what_to_pass(checkpoint, posttune_cli, tmp_path):
    """The usual slips: an adapter, a run's output folder or checkpoint, a reward model (its one-value head
    generated '')."""
    path, _ = checkpoint
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    reward = tmp_path / "rm"
    reward.mkdir()
    config = json.loads((Path(path) / "config.json").read_text())
    (reward / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"],
                                                    "num_labels": 1}))
    step = run / "checkpoints" / "step-00000010"  # a LoRA run's checkpoint keeps its adapter in model/
    (step / "model").mkdir(parents=True)
    (step / "model" / "adapter_config.json").write_text("{}")
    expected = {run / "adapter": "is a PEFT adapter (adapter_config.json); pass it as --adapter",
                run: f"holds an adapter; it is in {run / 'adapter'}: pass that as --adapter",
                step: f"holds an adapter; it is in {step / 'model'}: pass that as --adapter",
                reward: "is a sequence classifier (a reward or value model): it scores text and generates none; "
                        "give a causal language model"}
    for folder, words in expected.items():
        result = posttune_cli("generate", "--model", str(folder), "--prompt", "x")
        assert (result.exit_code, result.stderr) == (2, f"posttune: error: generate: --model {folder} {words}\n")
    for command in (["generate", "--prompt", "x"], ["merge", "-o", str(tmp_path / "merged")]):
        result = posttune_cli(*command, "--adapter", str(step))  # the summary's best_checkpoint, as it is named
        assert (result.exit_code, result.stderr) == (2, f"posttune: error: {command[0]}: --adapter {step}: no "
                                                        f"adapter_config.json there; it is in {step / 'model'}\n")


def test_several_prompts_print_each_completion_under_a_header_in_order(checkpoint, posttune_cli):
    path, _ = checkpoint
    prompts = ["The quick brown fox", "hello"]
    flags = ["--max-new-tokens", "16", "--show-ids"]
    alone = [posttune_cli("generate", "--model", str(path), "--prompt", p, *flags).stdout for p in prompts]
    result = posttune_cli("generate", "--model", str(path), "--prompt", prompts[0], "--prompt", prompts[1], *flags)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"=== [1/2] {prompts[0]}\n{alone[0]}=== [2/2] {prompts[1]}\n{alone[1]}"


def test_one_prompt_prints_just_its_completion(checkpoint, posttune_cli):
    path, tokenizer = checkpoint
    ids = tokenizer.encode("hello")
    result = posttune_cli("generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.stderr
    expected = reference(path, ids, 8, tokenizer.eos_ids)
    assert result.stdout == tokenizer.decode(expected, skip_special_tokens=True) + "\n"


def test_min_p_one_samples_the_greedy_completion(checkpoint, posttune_cli):
    path, _ = checkpoint
    args = ["generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "8", "--show-ids"]
    greedy = posttune_cli(*args)
    sampled = posttune_cli(*args, "--temperature", "1.0", "--min-p", "1.0", "--seed", "1")
    assert sampled.exit_code == 0, sampled.stderr
    assert sampled.stdout == greedy.stdout


def test_adapter_alone_finds_its_base_model(checkpoint, posttune_cli, tmp_path_factory):
    """`--adapter DIR` without `--model` loads the base its adapter_config.json names: the same text
    as `--model BASE --adapter DIR` (and not the base model's own)."""
    import peft

    path, _ = checkpoint
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapter = tmp_path_factory.mktemp("adapter")
    peft.get_peft_model(base, lora).save_pretrained(adapter)
    flags = ["--prompt", "The quick brown fox", "--max-new-tokens", "12", "--show-ids"]
    alone = posttune_cli("generate", "--adapter", str(adapter), *flags)
    both = posttune_cli("generate", "--model", str(path), "--adapter", str(adapter), *flags)
    plain = posttune_cli("generate", "--model", str(path), *flags)
    assert alone.exit_code == both.exit_code == plain.exit_code == 0, alone.stderr + both.stderr
    assert alone.stdout == both.stdout and alone.stdout != plain.stdout


def test_bf16_and_bfloat16_are_one_dtype(checkpoint, posttune_cli):
    path, _ = checkpoint
    outputs = [posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "4",
                            "--dtype", dtype, "--show-ids") for dtype in ("bf16", "bfloat16")]
    assert outputs[0].exit_code == 0, outputs[0].stderr
    assert outputs[0].stdout == outputs[1].stdout


def test_generate_without_model_or_adapter_is_one_line(checkpoint, posttune_cli):
    result = posttune_cli("generate", "--prompt", "hi")
    assert result.exit_code == 2 and result.stderr.strip().count("\n") == 0
    assert "--model" in result.stderr


def test_a_system_message_goes_before_each_chat_prompt(checkpoint, posttune_cli):
    """`--system` renders a system turn with the template (llama3's here), as transformers would."""
    path, tokenizer = checkpoint
    system, prompt = "You answer in one word.", "The quick brown fox"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False) == tokenizer.decode(ids)
    flags = ["--model", str(path), "--prompt", prompt, "--chat", "--max-new-tokens", "12", "--show-ids"]
    with_system, without = posttune_cli("generate", *flags, "--system", system), posttune_cli("generate", *flags)
    assert with_system.exit_code == 0, with_system.stderr
    ours = [int(i) for i in with_system.stdout.rstrip("\n").rsplit("\n", 1)[1].split()]
    assert ours == reference(path, ids, 12, tokenizer.eos_ids)
    assert with_system.stdout != without.stdout


def test_system_without_chat_is_one_line(checkpoint, posttune_cli):
    path, _ = checkpoint
    result = posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--system", "be brief")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "--system needs --chat" in result.stderr


def test_tools_reach_the_chat_template_as_transformers_renders_them(checkpoint, posttune_cli, tmp_path):
    path, tokenizer = checkpoint
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}}}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    messages = [{"role": "user", "content": "add one"}]
    text = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"name": "add"' in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    flags = ["--model", str(path), "--prompt", "add one", "--chat", "--max-new-tokens", "6", "--show-ids"]
    result = posttune_cli("generate", *flags, "--tools", str(tmp_path / "tools.json"))
    assert result.exit_code == 0, result.stderr
    assert [int(i) for i in result.stdout.rstrip("\n").rsplit("\n", 1)[1].split()] == reference(
        path, ids, 6, tokenizer.eos_ids)
    (tmp_path / "bad.json").write_text('{"name": "add"}')
    bad = posttune_cli("generate", *flags, "--tools", str(tmp_path / "bad.json"))
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1
    assert f"--tools {tmp_path / 'bad.json'}: field 'tools' must be a non-empty list" in bad.stderr
    plain = posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--tools", str(tmp_path / "tools.json"))
    assert plain.exit_code == 2 and "--tools needs --chat" in plain.stderr


def test_a_model_built_from_a_size_saves_the_tokenizers_stop_tokens(tmp_path, register_plugin):
    """A run from random init (the README demo's) wrote no token ids: transformers' generate fell back to
    LlamaConfig's eos 2 (another token here) and ran to max_new_tokens; the tokenizer's second stop token was lost."""
    from posttune.api import build_model, save_model

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    save_tiny_tokenizer(tmp_path / "tok", template="llama3")
    (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 1]}))
    tokenizer = load_tokenizer(tmp_path / "tok")
    save_model(build_model("llama", "tiny", vocab_size=tokenizer.vocab_size), tmp_path / "out", tokenizer=tokenizer)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (config.bos_token_id, config.eos_token_id, generation.bos_token_id, generation.eos_token_id) == (
        tokenizer.bos_id, [4, 1], tokenizer.bos_id, [4, 1])
    assert config.pad_token_id is None  # the tokenizer has no pad token: none is made up
