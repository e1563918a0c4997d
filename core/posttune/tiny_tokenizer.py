"""Tiny real tokenizers for tests and demos: no hub, built in well under a second.

    path = save_tiny_tokenizer(tmp_path / "tok", template="llama3")
    tok = posttune.tokenizer.load_tokenizer(path)          # or AutoTokenizer.from_pretrained(path)

Each is a byte-level BPE trained with the `tokenizers` library on a small built-in corpus, so
every string (CJK, emoji, tabs) round-trips, and the vocabulary stays small (384 ids by
default) so tiny models stay tiny. The files are the ones a real checkpoint ships
(`tokenizer.json`, `tokenizer_config.json` with a chat template in the style of the family),
so the code under test takes the same path as with a real model.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Literal

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

Template = Literal["llama3", "chatml", "start_of_turn"]

# Template texts follow the published ones of each family in structure (headers, end-of-turn
# tokens, trimming, the role checks that raise), written here from scratch and kept short.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if tools is not none %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
    {{- 'You can call these functions:\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=2) + '\\n' }}
    {%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
{%- endif %}
{%- if tools %}
    {{- '\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role != 'system' or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set function = call.function if call.function is defined else call %}
            {{- ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n' + function | tojson }}
            {{- '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# Per style: special tokens (in id order, first ids of the vocabulary), named roles, template.
STYLES: dict[str | None, dict] = {
    "llama3": {
        "tokens": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"],
        "named": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "template": LLAMA3_TEMPLATE,
    },
    "chatml": {
        "tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "named": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "template": CHATML_TEMPLATE,
    },
    "start_of_turn": {
        "tokens": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        "named": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        "template": GEMMA_TEMPLATE,
    },
    None: {
        "tokens": ["<|endoftext|>"],
        "named": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        "template": None,
    },
}

CORPUS = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n\tprint(i)\n
The model was trained on the data, and the results were good. You are a helpful assistant.
User: please answer the question. Assistant: Sure, here is the answer to your question.
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14; symbols ( ) [ ] { } < > = + - * / # @ ! ? : ;
Café, naïve, résumé, über, señor. 日本語のテキスト。中文文本。한국어 텍스트. Emoji 🙂🚀👍🏽.
"""


def build_tiny_tokenizer(template: Template | None = "llama3", *, vocab_size: int = 384) -> Tokenizer:
    """Train the tokenizer of a style; its special tokens take the first ids.

    Gemma's is SentencePiece-like (``▁`` for spaces, ``<0xNN>`` byte fallback), the others are
    byte-level like Llama 3's and Qwen's: both kinds of pipeline real checkpoints ship.
    """
    style = STYLES[template]
    if vocab_size <= 256 + len(style["tokens"]):
        raise ValueError(f"vocab_size {vocab_size}: a tiny tokenizer holds its 256 bytes and "
                         f"{len(style['tokens'])} special tokens, and learns merges on top: ask for more")
    sentencepiece = template == "start_of_turn"
    tokenizer = _sentencepiece_bpe(style, vocab_size) if sentencepiece else _byte_level_bpe(style, vocab_size)
    bos = style["named"].get("bos_token")
    if template in ("llama3", "start_of_turn"):  # like their tokenizer.json: the post-processor adds BOS
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    if tokenizer.get_vocab_size() != vocab_size:  # a model sized to vocab_size would not match it
        raise ValueError(f"vocab_size {vocab_size}: this tiny tokenizer comes out with {tokenizer.get_vocab_size()} "
                         "ids (it holds at least its 256 bytes and special tokens, and at most the merges its small "
                         "corpus gives); ask for that size")
    return tokenizer


def _byte_level_bpe(style: dict, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=style["tokens"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    return tokenizer


def _sentencepiece_bpe(style: dict, vocab_size: int) -> Tokenizer:
    """Specials, then the 256 ``<0xNN>`` byte tokens, then what BPE learns on the corpus (as Gemma orders them)."""
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "▁")
    learner.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    counts = Counter(CORPUS.replace(" ", "▁").replace("\n", ""))  # the 60 most frequent, ties by character: the
    alphabet = sorted(counts, key=lambda char: (-counts[char], char))[:60]  # trainer breaks ties differently per run
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=style["tokens"], show_progress=False,
                                  limit_alphabet=60, initial_alphabet=alphabet)
    learner.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab = {token: index for index, token in enumerate(style["tokens"])}
    vocab.update({f"<0x{byte:02X}>": len(style["tokens"]) + byte for byte in range(256)})
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = learner.normalizer
    tokenizer.pre_tokenizer = learner.pre_tokenizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in style["tokens"]])
    return tokenizer


def tokenizer_config(template: Template | None, tokenizer: Tokenizer) -> dict:
    """The ``tokenizer_config.json`` a checkpoint of that style ships (loadable by AutoTokenizer)."""
    style = STYLES[template]
    tokenizer_class = "GemmaTokenizer" if template == "start_of_turn" else "PreTrainedTokenizerFast"
    config: dict = {"tokenizer_class": tokenizer_class, "model_max_length": 2048,
                    "clean_up_tokenization_spaces": False, **style["named"]}
    config["added_tokens_decoder"] = {
        str(tokenizer.token_to_id(token)): {"content": token, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}
        for token in style["tokens"]}
    if template == "start_of_turn":  # as Gemma ships it; transformers 5 ignores both when tokenizer.json exists
        config.update(add_bos_token=True, add_eos_token=False)
    if style["template"] is not None:
        config["chat_template"] = style["template"]
    return config


def save_tiny_tokenizer(path: str | Path, *, template: Template | None = "llama3",
                        vocab_size: int = 384) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a tiny tokenizer into ``path``."""
    if template not in STYLES:
        raise ValueError(f"unknown template style {template!r} (expected llama3, chatml, start_of_turn or None)")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(template, vocab_size=vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    config = tokenizer_config(template, tokenizer)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return out
