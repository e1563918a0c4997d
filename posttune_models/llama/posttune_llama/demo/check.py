"""Score a trained demo model: greedy answers to the reversal prompts, exact match or not.

    python -m posttune_llama.demo.check outputs/llama-demo-reverse/model

prints the exact-match accuracy on the bundled validation split (strings the model never
trained on) and the answers to the demo's sample prompts and the README's example, as JSON.
The demo test and `benchmarks/demo_seeds.py` use the same function, so the README's claims are
what they measure.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path
from typing import Any

#: the config's three sample prompts and the README's `posttune generate` example, none of them in the data
SAMPLE_WORDS = ("PLUGIN", "TORCH", "HELLO", "KERNEL")


def validation_words(path: str | Path | None = None) -> list[str]:
    """The words of a reversal dataset file (default: the bundled validation split)."""
    source = Path(path) if path else resources.files("posttune_llama.demo").joinpath("reverse_validation.jsonl")
    text = source.read_text()
    return [json.loads(line)["messages"][0]["content"].removeprefix("Reverse: ") for line in text.splitlines()
            if line.strip()]


def answers(model_dir: str | Path, words: list[str], *, max_new_tokens: int = 12) -> dict[str, str]:
    """Greedy answer of the model in ``model_dir`` to "Reverse: WORD", for each word."""
    import torch

    from posttune.plugin import Sampling, complete, load_model, load_tokenizer

    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    sampling = Sampling(max_new_tokens, stop_token_ids=tokenizer.eos_ids)  # greedy
    out = {}
    with torch.no_grad():
        for word in words:  # one at a time, as `posttune generate` answers the README's example
            ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Reverse: {word}"}],
                                                add_generation_prompt=True)
            new = complete(model, [ids], sampling).token_lists()[0]
            out[word] = tokenizer.decode(new, skip_special_tokens=True).strip()
    return out


def score(model_dir: str | Path, validation: str | Path | None = None) -> dict[str, Any]:
    """Exact-match accuracy on the validation split and the sample prompts' answers."""
    words = validation_words(validation)
    got = answers(model_dir, [*words, *SAMPLE_WORDS])
    correct = sum(got[w] == w[::-1] for w in words)
    return {
        "exact_match": correct / len(words),
        "validation_rows": len(words),
        "samples": {w: got[w] for w in SAMPLE_WORDS},
        "samples_right": all(got[w] == w[::-1] for w in SAMPLE_WORDS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the trained model directory (OUTPUT_DIR/model)")
    parser.add_argument("--validation", help="a reversal .jsonl file (default: the bundled validation split)")
    args = parser.parse_args()
    print(json.dumps(score(args.model, args.validation), indent=2))


if __name__ == "__main__":
    main()
