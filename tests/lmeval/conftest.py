"""Session fixtures of the posttune-lmeval tests (the pieces live in lmeval_tasks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmeval_tasks import (
    CHAT_CONTEXT,
    CHOICES,
    CONTEXT,
    GEN_YAML,
    MAX_GEN,
    MC_YAML,
    PPL_YAML,
    PREFIX_MC_YAML,
    QUESTIONS,
    TEXTS,
    greedy_answers,
    write_jsonl,
)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tokenizer (llama3 style, BOS added by encode) and a random 2-layer Llama with a 32-token context."""
    from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
    from posttune.tiny_tokenizer import save_tiny_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_tokenizer(path, template="llama3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = tiny_llama_config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, max_position_embeddings=CONTEXT)
    save_tiny_hf_checkpoint(path, config, seed=3)
    return path


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    """The tokenizer of tiny_checkpoint (its llama3-style chat template included) and a random Llama with a
    256-token context: chat prompts with a system message and few-shot turns fit without being cut."""
    from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config
    from posttune.tiny_tokenizer import save_tiny_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat-llama")
    save_tiny_tokenizer(path, template="llama3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    config = tiny_llama_config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, max_position_embeddings=CHAT_CONTEXT)
    save_tiny_hf_checkpoint(path, config, seed=5)
    return path


@pytest.fixture(scope="session")
def task_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """tiny_mc (acc, acc_norm), tiny_gen (exact_match 0.5 by construction), tiny_ppl (perplexities), and
    tiny_mc_prefix (tiny_mc with an assistant prefix to continue, for chat templates)."""
    tasks = tmp_path_factory.mktemp("tasks")
    mc = write_jsonl(tasks / "mc.jsonl", [{"question": q, "choices": CHOICES, "label": i % len(CHOICES)}
                                          for i, q in enumerate(QUESTIONS)])
    answers = greedy_answers(tiny_checkpoint, QUESTIONS, "\n")
    gen = write_jsonl(tasks / "gen.jsonl", [{"prompt": q, "answer": a if i % 2 == 0 else a + " (not this)"}
                                            for i, (q, a) in enumerate(zip(QUESTIONS, answers, strict=True))])
    ppl = write_jsonl(tasks / "ppl.jsonl", [{"text": text} for text in TEXTS])
    (tasks / "tiny_mc.yaml").write_text(MC_YAML.format(data=mc), encoding="utf-8")
    (tasks / "tiny_mc_prefix.yaml").write_text(PREFIX_MC_YAML.format(data=mc), encoding="utf-8")
    (tasks / "tiny_gen.yaml").write_text(GEN_YAML.format(data=gen, max_gen=MAX_GEN), encoding="utf-8")
    (tasks / "tiny_ppl.yaml").write_text(PPL_YAML.format(data=ppl), encoding="utf-8")
    return tasks
