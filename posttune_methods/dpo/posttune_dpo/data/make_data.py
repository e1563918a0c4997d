"""Regenerate the tiny DPO example's bundled preference data.

    python -m posttune_dpo.data.make_data

Each row asks to reverse a string of capital letters. The chosen answer is the reversal; the
rejected one is the string copied as it was. Telling them apart takes attention to the prompt
(is the answer the prompt backwards?), which a tiny random model learns from the preferences
alone in about a minute, so validation reward accuracy climbs from chance. Strings of 3-6
letters; train and validation share none.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).parent
SEED = 4321
TRAIN_ROWS, VALIDATION_ROWS = 2000, 100


def row(word: str) -> dict:
    return {"prompt": f"Reverse: {word}", "chosen": word[::-1], "rejected": word}


def main() -> None:
    rng = random.Random(SEED)
    seen: set[str] = set()
    for name, count in (("reverse_preferences_train.jsonl", TRAIN_ROWS),
                        ("reverse_preferences_validation.jsonl", VALIDATION_ROWS)):
        lines = []
        while len(lines) < count:
            word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 6)))
            if word not in seen and word != word[::-1]:  # a palindrome would prefer an answer over itself
                seen.add(word)
                lines.append(json.dumps(row(word)))
        (HERE / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
