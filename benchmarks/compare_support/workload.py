"""The synthetic workload: pseudo-word text, a BPE tokenizer trained on it, alpaca and preference
rows of chosen token lengths, and a random-init Llama checkpoint written by transformers.

Everything is seeded, so two builds give the same files. Lengths are measured with posttune's
own tokenizer and chat template (the same ids transformers' ``apply_chat_template`` gives; the
HF side checks it row by row).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

#: The measured model: Llama architecture, ~28.5M parameters (untied embeddings), fp32.
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
         "intermediate_size": 1376, "vocab_size": 3072}
#: --quick: the same pipeline with a model small enough for a smoke check.
QUICK_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
               "intermediate_size": 172, "vocab_size": 3072}
TOKENIZER_VOCAB = 3072
#: shortest and longest row (prompt and response together, chat template included), in tokens
MIN_TOKENS, MAX_TOKENS = 18, 305

INSTRUCTIONS = ["Summarise the notes below.", "Rewrite this as a short report.", "Answer the question.",
                "Translate the passage into plain words.", "Explain what the text says.", "Continue the story.",
                "List the main points.", "Describe the scene."]
SHORT_INSTRUCTIONS = ["Reply.", "Go on.", "Answer."]  # rows near MIN_TOKENS
#: the split pattern of Llama 3's tokenizer.json
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def parameter_count(shape: dict[str, int]) -> int:
    """Parameters of a Llama of ``shape`` with untied embeddings and no biases."""
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    attention = h * head_dim * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    per_layer = attention + 3 * h * i + 2 * h
    return 2 * v * h + layers * per_layer + h


class Words:
    """A seeded pool of pseudo-words drawn with Zipf-like frequencies (a few common, many rare)."""

    def __init__(self, seed: int = 0, pool: int = 4000):
        rng = random.Random(seed)
        onsets, vowels, codas = "bdfgklmnprstvz", "aeiou", ["", "", "n", "r", "s", "l", "th"]
        words: set[str] = set()
        while len(words) < pool:
            words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                              for _ in range(rng.choice((1, 2, 2, 3)))))
        self.pool = sorted(words)
        rng.shuffle(self.pool)
        self.weights = [1.0 / (rank + 1) ** 0.9 for rank in range(pool)]
        self.rng = rng

    def sentence(self, count: int | None = None) -> str:
        count = count or self.rng.randint(5, 15)
        words = self.rng.choices(self.pool, weights=self.weights, k=count)
        return " ".join(words).capitalize() + self.rng.choice(".....?!")

    def text(self, words: int) -> str:
        """About ``words`` words, as sentences."""
        out, left = [], words
        while left > 0:
            n = min(left, self.rng.randint(5, 15))
            out.append(self.sentence(n))
            left -= n
        return " ".join(out)


def build_tokenizer(out_dir: Path, *, seed: int = 0, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """A byte-level BPE trained on the pseudo-word text, with Llama 3's special tokens and a
    Llama-3-style chat template (``tokenizer.json`` + ``tokenizer_config.json``)."""
    from posttune.tiny_tokenizer import STYLES, tokenizer_config
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    style = STYLES["llama3"]
    words = Words(seed)
    # the chat template's own words, so that its headers are one token each as in a real vocabulary
    template_words = ["user\n\n", "assistant\n\n", "system\n\n"] * 200
    corpus = [words.sentence() for _ in range(20000)] + INSTRUCTIONS + SHORT_INSTRUCTIONS + template_words
    tokenizer = Tokenizer(models.BPE())
    # Llama 3's pre-tokenizer: its split pattern, then bytes; newlines stay one piece whatever
    # follows them, so a rendered prompt tokenizes the same alone and before its response.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=style["tokens"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    bos = style["named"]["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config("llama3", tokenizer), indent=2) + "\n")
    return out_dir


class RowMaker:
    """Rows whose rendered length (posttune's tokenizer and chat template) hits a target."""

    def __init__(self, tokenizer_dir: Path, seed: int):
        from posttune.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.words = Words(seed)
        self.rng = random.Random(seed + 1)

    def length(self, messages: list[dict[str, str]]) -> int:
        return len(self.tokenizer.tokenize_messages(messages)[0])

    def fit(self, target: int, build: Any, longest: int) -> tuple[Any, int]:
        """The smallest word count k (binary search) whose ``build(k)`` renders to >= target tokens."""
        lo, hi = 1, longest
        while lo < hi:
            mid = (lo + hi) // 2
            if self.length(build(mid)[1]) >= target:
                hi = mid
            else:
                lo = mid + 1
        row, messages = build(lo)
        return row, self.length(messages)

    def targets(self, count: int) -> list[int]:
        """Row lengths spread over [MIN_TOKENS, MAX_TOKENS], both ends included."""
        values = [self.rng.randint(MIN_TOKENS, MAX_TOKENS) for _ in range(count)]
        if count >= 2:
            values[0], values[1] = MIN_TOKENS, MAX_TOKENS
        self.rng.shuffle(values)
        return values

    def alpaca(self, target: int) -> tuple[dict[str, str], int]:
        instruction = self.rng.choice(INSTRUCTIONS if target >= 40 else SHORT_INSTRUCTIONS)
        prompt_words = max(0, int(target * 0.3 / 1.6) - 6)
        extra = self.words.text(prompt_words) if prompt_words and self.rng.random() < 0.7 else ""
        response = self.words.text(400).split(" ")

        def build(k: int) -> tuple[dict[str, str], list[dict[str, str]]]:
            row = {"instruction": instruction, "input": extra, "output": " ".join(response[:k])}
            prompt = f"{instruction}\n\n{extra}" if extra else instruction  # posttune's alpaca format
            return row, [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]

        return self.fit(target, build, len(response))

    def preference(self, target: int) -> tuple[dict[str, Any], int, int]:
        prompt = [{"role": "user", "content": self.words.text(max(1, int(target * 0.3 / 1.6) - 4))}]
        answers = []
        for goal in (target, self.rng.randint(max(MIN_TOKENS, target // 2), MAX_TOKENS)):
            response = self.words.text(400).split(" ")

            def build(k: int, response: list[str] = response) -> tuple[list, list]:
                message = [{"role": "assistant", "content": " ".join(response[:k])}]
                return message, prompt + message

            answers.append(self.fit(goal, build, len(response)))
        (chosen, chosen_len), (rejected, rejected_len) = answers
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}, chosen_len, rejected_len


def write_rows(tokenizer_dir: Path, out_dir: Path, *, rows: int, seed: int = 0) -> dict[str, Any]:
    """``sft.jsonl`` (alpaca rows) and ``dpo.jsonl`` (explicit-prompt preference rows, as
    messages: posttune's ``preference`` format and TRL's conversational format both read them)."""
    maker = RowMaker(tokenizer_dir, seed)
    sft, sft_lengths = [], []
    for target in maker.targets(rows):
        row, length = maker.alpaca(target)
        sft.append(row)
        sft_lengths.append(length)
    dpo, dpo_lengths = [], []
    for target in maker.targets(rows):
        row, chosen, rejected = maker.preference(target)
        dpo.append(row)
        dpo_lengths += [chosen, rejected]
    for name, data in (("sft.jsonl", sft), ("dpo.jsonl", dpo)):
        (out_dir / name).write_text("".join(json.dumps(row) + "\n" for row in data))

    def stats(lengths: list[int]) -> dict[str, float]:
        return {"rows": len(lengths), "min": min(lengths), "max": max(lengths),
                "mean": round(sum(lengths) / len(lengths), 1), "total": sum(lengths)}

    return {"sft_tokens": stats(sft_lengths), "dpo_sequence_tokens": stats(dpo_lengths)}


def save_checkpoint(out_dir: Path, shape: dict[str, int], *, seed: int = 0, max_positions: int = 1024) -> int:
    """A random-init ``LlamaForCausalLM`` of ``shape`` saved by transformers (fp32 safetensors);
    returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=max_positions, tie_word_embeddings=False,
                         rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=4,
                         attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())
