"""Regenerate the demo's bundled files: a tiny llama3-style tokenizer and the reversal dataset.

    python -m posttune_llama.demo.make_demo

The skill: given "Reverse: QWERT", answer "TREWQ". Capital letters are one token each in the
tiny tokenizer, so the model must learn to copy tokens in mirrored order: impossible by
chance, learnable in a few CPU minutes, and checkable on strings it never saw.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).parent
SEED = 1234
TRAIN_ROWS, VALIDATION_ROWS = 4000, 200
LENGTHS = (3, 6)


def words(rng: random.Random, count: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(*LENGTHS)))
        if word not in exclude:
            exclude.add(word)
            out.append(word)
    return out


def row(word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Reverse: {word}"},
                         {"role": "assistant", "content": word[::-1]}]}


def main() -> None:
    from posttune.plugin import save_tiny_tokenizer

    save_tiny_tokenizer(HERE / "tokenizer", template="llama3")
    rng = random.Random(SEED)
    seen: set[str] = {"PLUGIN", "TORCH", "HELLO", "KERNEL"}  # kept out of the data: check.SAMPLE_WORDS
    for name, count in (("reverse_train.jsonl", TRAIN_ROWS), ("reverse_validation.jsonl", VALIDATION_ROWS)):
        lines = [json.dumps(row(word)) for word in words(rng, count, seen)]
        (HERE / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
