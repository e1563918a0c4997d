"""`python -m posttune_grpo.example prepare|make-data` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

HERE = Path(__file__).parent
SEED = 2468
ROWS = {"prompts_train.jsonl": 2000, "prompts_validation.jsonl": 64, "warmup_chats.jsonl": 2000}
LENGTHS = (3, 6)
#: the model GRPO starts from: the demo's width and depth, as a Qwen3 model with the bundled tokenizer. Heads of
#: 32 (8 of them; Qwen3's head size is its own, not hidden / heads), because vLLM's CPU attention runs heads of
#: 32 and up (posttune-vllm); 4 heads of 32 learn too slowly (0 of 64 validation reversals after the warm start)
MODEL = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 32, "max_position_embeddings": 256, "tie_word_embeddings": True}
FAMILY = "qwen3"


def make_data() -> None:
    """The bundled tokenizer and data: prompts with answers (GRPO) and chats (the warm start)."""
    from posttune.plugin import save_tiny_tokenizer

    save_tiny_tokenizer(HERE / "tokenizer", template="chatml")
    rng, seen = random.Random(SEED), set()
    for name, count in ROWS.items():
        lines = []
        while len(lines) < count:
            word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(*LENGTHS)))
            if word in seen:
                continue
            seen.add(word)
            if name.startswith("prompts"):
                row = {"prompt": f"Reverse: {word}", "answer": word[::-1]}
            else:
                row = {"messages": [{"role": "user", "content": f"Reverse: {word}"},
                                    {"role": "assistant", "content": word[::-1]}]}
            lines.append(json.dumps(row))
        (HERE / name).write_text("\n".join(lines) + "\n")


def prepare(out: Path, steps: int, seed: int = 0) -> Path:
    """A few hundred supervised steps on the warm-up chats, saved as an HF checkpoint at ``out``."""
    import torch

    from posttune.plugin import build_model, load_tokenizer, save_model, train_briefly

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(HERE / "tokenizer")
    model = build_model(FAMILY, "tiny", **MODEL)
    train_briefly(model, tokenizer, HERE / "warmup_chats.jsonl", steps=steps, seed=seed)
    return save_model(model, out, tokenizer=tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m posttune_grpo.example", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("prepare", help="train the warm start GRPO begins from")
    ready.add_argument("--out", default="outputs/grpo-tiny-start/model", help="where to save it (an HF checkpoint)")
    ready.add_argument("--steps", type=int, default=450, help="supervised steps (few on purpose)")
    commands.add_parser("make-data", help="regenerate the bundled tokenizer and data files")
    args = parser.parse_args()
    if args.command == "make-data":
        make_data()
    else:
        print(f"saved the warm start to {prepare(Path(args.out), args.steps)}")


if __name__ == "__main__":
    main()
