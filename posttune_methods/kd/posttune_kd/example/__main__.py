"""`python -m posttune_kd.example prepare-teacher` (see the package docstring)."""

from __future__ import annotations

import argparse
from importlib.resources import files
from pathlib import Path

#: the teacher: posttune-llama's demo shape (the student in kd-tiny-reverse is half as wide and deep)
TEACHER = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "num_heads": 8,
           "num_kv_heads": 4, "head_dim": 16, "max_position_embeddings": 256}


def demo_file(name: str) -> Path:
    """A file of posttune-llama's demo (its tokenizer and reversal chats), wherever it is installed."""
    return Path(str(files("posttune_llama") / "demo" / name))


def prepare_teacher(out: Path, steps: int, seed: int = 0) -> Path:
    """``steps`` supervised steps on the demo's reversal chats, saved as an HF checkpoint at ``out``."""
    import torch
    from posttune.plugin import build_model, load_tokenizer, save_model, train_briefly

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(demo_file("tokenizer"))
    model = build_model("llama", "tiny", **TEACHER)
    train_briefly(model, tokenizer, demo_file("reverse_train.jsonl"), steps=steps, seed=seed)
    return save_model(model, out, tokenizer=tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m posttune_kd.example", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    teacher = commands.add_parser("prepare-teacher", help="train the tiny teacher kd-tiny-reverse distils")
    teacher.add_argument("--out", default="outputs/kd-tiny-teacher/model", help="where to save it (an HF checkpoint)")
    teacher.add_argument("--steps", type=int, default=800, help="supervised steps")
    args = parser.parse_args()
    print(f"saved the teacher to {prepare_teacher(Path(args.out), args.steps)}")


if __name__ == "__main__":
    main()
