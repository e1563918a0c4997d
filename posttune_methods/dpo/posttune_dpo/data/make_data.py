"""Regenerate the tiny DPO and KTO examples' bundled data: preference pairs, and unpaired feedback from them.

    python -m posttune_dpo.data.make_data

Each row asks to reverse a string of capital letters. The chosen answer is the reversal; the
rejected one is the string copied as it was. Telling them apart takes attention to the prompt
(is the answer the prompt backwards?), which a tiny random model learns from the preferences
alone in about a minute, so validation reward accuracy climbs from chance. Strings of 3-6
letters; train and validation share none.

KTO's unpaired rows (``reverse_feedback_*.jsonl``, format ``unpaired``) come from the same pairs:
the desirable completion is the reversal, the undesirable one the string copied *in lowercase*
(``BNZCF`` -> ``bnzcf``). Each training pair gives ONE row, desirable or undesirable by a seeded
coin, so no prompt is seen with both answers; each validation pair gives both rows, so the
validation rewards of desirable and undesirable answers are measured on the same prompts. The
lowercase copy makes the two answers tell apart by their tokens alone: from a random
initialisation, KTO does not learn to tell the reversal from the uppercase copy in a CPU minute
(measured: both answers' validation rewards equal after 750 steps), since, unlike DPO's, its
loss never contrasts the two answers of one prompt.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).parent
SEED = 4321
TRAIN_ROWS, VALIDATION_ROWS = 2000, 100
FEEDBACK_SEED = 8765


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
    feedback()


def feedback() -> None:
    """KTO's unpaired rows from the preference files: one per training pair, both per validation pair; the
    undesirable answer is the rejected one in lowercase."""
    rng = random.Random(FEEDBACK_SEED)
    for split in ("train", "validation"):
        lines = []
        for line in (HERE / f"reverse_preferences_{split}.jsonl").read_text().splitlines():
            pair = json.loads(line)
            labels = [rng.random() < 0.5] if split == "train" else [True, False]
            lines += [json.dumps({"prompt": pair["prompt"],
                                  "completion": pair["chosen"] if label else pair["rejected"].lower(),
                                  "label": label}) for label in labels]
        (HERE / f"reverse_feedback_{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
