"""``tokenizer.chat_template_kwargs``: variables every render of the chat template gets (Qwen3's
``enable_thinking: false``), in the run's training text and generation prompts, and in `posttune generate
--chat-template-kwargs`; each rendered as transformers' ``apply_chat_template(..., **kwargs)`` renders it."""

from __future__ import annotations

import json
from pathlib import Path

import posttune_llama
import posttune_generate
import posttune_lora
import pytest
import torch
import transformers
from test_chat_template_override import session_for

from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

EMPTY_THINKING = "<think>\\n\\n</think>\\n\\n"
CHAT = [{"role": "user", "content": "Reverse: ABC"}, {"role": "assistant", "content": "CBA"}]


def thinking_tokenizer(path: Path) -> Path:
    """The tiny ChatML tokenizer, its template made to write an empty thinking block before each answer (and
    after the generation prompt) when ``enable_thinking`` is false, as Qwen3's does."""
    save_tiny_tokenizer(path, template="chatml")
    config = json.loads((path / "tokenizer_config.json").read_text())
    off = "enable_thinking is defined and enable_thinking is false"
    template = config["chat_template"].replace(
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}",
        "{{- '<|im_start|>' + message.role + '\\n' }}"
        f"{{%- if message.role == 'assistant' and {off} %}}{{{{- '{EMPTY_THINKING}' }}}}{{%- endif %}}"
        "{{- message.content or '' }}")
    template = template.replace("{{- '<|im_start|>assistant\\n' }}",
                                "{{- '<|im_start|>assistant\\n' }}"
                                f"{{%- if {off} %}}{{{{- '{EMPTY_THINKING}' }}}}{{%- endif %}}")
    assert template.count(off) == 2
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_run_renders_its_chats_with_the_template_kwargs(llama_sft, write_config, tmp_path):
    folder = thinking_tokenizer(tmp_path / "tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    data = {"max_seq_len": 128}  # ChatML's default system turn is long in a 384-id tokenizer
    plain = session_for(write_config("plain.yaml", tokenizer={"path": str(folder)}, data=data))
    session = session_for(write_config(tokenizer={"path": str(folder),
                                                  "chat_template_kwargs": {"enable_thinking": False}},
                                       data=data))
    for generation_prompt, messages in ((False, CHAT), (True, CHAT[:1])):
        text = session.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  enable_thinking=False)
        assert "<think>" in text
        assert "<think>" not in plain.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                                    tokenize=False)
    # the training text itself: the thinking block is in the rows; as the generation prompt ends with it, it is
    # the prompt's, not the answer's, so it is not trained on (the answer after it is)
    think = session.tokenizer.encode("<think>", add_special_tokens=False)
    batch = next(iter(session.train_data))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    starts = [i for i in range(len(ids)) if ids[i:i + len(think)] == think]
    assert starts and all(labels[i - 1] == -100 for i in starts)  # labels are shifted: position i-1 predicts i
    assert sum(label != -100 for label in labels) == sum(label != -100 for label in
                                                         next(iter(plain.train_data))["labels"][0].tolist())
    plain_ids = next(iter(plain.train_data))["input_ids"][0].tolist()
    assert not any(plain_ids[i:i + len(think)] == think for i in range(len(plain_ids)))


@pytest.mark.parametrize(("name", "message"), [
    ("messages", "config: tokenizer.chat_template_kwargs.messages: set by posttune for each render"),
    ("add_generation_prompt", "config: tokenizer.chat_template_kwargs.add_generation_prompt: set by posttune"),
])
def test_a_variable_the_render_sets_itself_is_refused(llama_sft, posttune_cli, write_config, name, message):
    result = posttune_cli("validate", str(write_config(tokenizer={"chat_template_kwargs": {name: True}})))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"posttune: error: {message}"), result.stderr


def test_generate_renders_its_prompt_with_the_kwargs(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    path = thinking_tokenizer(tmp_path)
    tokenizer = load_tokenizer(path)
    save_tiny_hf_checkpoint(path, tiny_llama_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                                    eos_token_id=tokenizer.eos_ids), seed=3)
    flags = ["--model", str(path), "--prompt", "Reverse: ABC", "--chat", "--max-new-tokens", "4"]
    text = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        CHAT[:1], add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert "<think>" in text
    prompt = tokenizer.encode(text, add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tokenizer.eos_ids
    expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=4, eos_token_id=eos, pad_token_id=eos[0])
    result = posttune_cli("generate", *flags, "--show-ids", "--chat-template-kwargs", '{"enable_thinking": false}')
    assert result.exit_code == 0, result.stderr
    ours = [int(i) for i in result.stdout.rstrip("\n").rsplit("\n", 1)[1].split()]
    assert ours == expected[0, len(prompt):].tolist()
    for bad, message in (("[1]", "expected a JSON object"), ("{x", "not JSON"),
                         ('{"tools": []}', "tools is set by the render itself")):
        refused = posttune_cli("generate", *flags, "--chat-template-kwargs", bad)
        assert refused.exit_code == 2 and message in refused.stderr and refused.stderr.count("\n") == 1
    plain = posttune_cli("generate", "--model", str(path), "--prompt", "hi", "--chat-template-kwargs", "{}")
    assert plain.exit_code == 2 and "--chat-template-kwargs needs --chat" in plain.stderr
