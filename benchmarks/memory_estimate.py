"""`posttune plan`'s peak-memory estimate against the measured peak of real training runs.

    python benchmarks/memory_estimate.py                     # every configuration, JSON to stdout
    python benchmarks/memory_estimate.py --only small-full medium-lora --out result.json

Each configuration is a random-init Llama (posttune-llama) trained for ``--steps`` optimizer
steps on the CPU through posttune's real path (validate -> resolve_plan -> compose -> train; the
final save is not part of it), in a fresh subprocess that reports its peak resident memory. The
data fill every micro-batch, the worst case the estimate assumes:

- SFT (``small-full`` ...): plain-text rows longer than ``max_seq_len``: ``batch_size x
  max_seq_len`` tokens per micro-batch.
- DPO (``small-dpo-full`` ...): a short prompt, chosen and rejected responses longer than
  ``max_seq_len`` (cut to it): ``2 x batch_size x max_seq_len`` tokens in one forward, and a
  forward of the reference (a frozen copy with full fine-tuning, the policy without adapters
  with LoRA) on the same tokens.
- GRPO (``small-grpo-full`` ...): prompts longer than ``data.max_prompt_len`` (their tail kept),
  completions sampled from the random-init model, which almost never stops before
  ``max_new_tokens``: ``micro_batch_size x (max_prompt_len + max_new_tokens)`` tokens.

Why ``VmHWM`` (``/proc/self/status``) and not ``ru_maxrss``: Linux carries the parent's peak
into ``ru_maxrss`` across fork + exec (``subprocess`` included), so a child started from a
process that imported torch reports at least the parent's peak. ``VmHWM`` is the peak of the
child's own address space (the same number ``ru_maxrss`` gives when the parent is small); it is
used where it exists, ``ru_maxrss`` elsewhere.

The estimate is computed in this process (``posttune.estimate`` on the resolved plan: a meta-device
build, no weights), so the comparison is exactly what `posttune plan CONFIG` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20

CHILD = r'''
import json, resource, sys
def peak():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
import torch
from posttune.config import validate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from posttune.training.compose import compose
from posttune.training.trainer import train
config = json.loads(sys.argv[1])
session = compose(resolve_plan(validate(config), get_registry()))
setup = peak()
train(session)
rows = [json.loads(line) for line in open(config["checkpoint"]["output_dir"] + "/metrics.jsonl") if '"loss"' in line]
print(json.dumps({"setup_peak": setup, "peak": peak(), "tokens_per_step": [row["tokens"] for row in rows]}))
'''

#: ~10M parameters (4.7M in the decoder layers, 4.2M embedding + head), GQA 8/4
SMALL = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768, "num_layers": 6, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 32, "tie_word_embeddings": False}
#: ~42M parameters (25M in the decoder layers, 16.8M embedding + head), GQA 8/4
MEDIUM = {"vocab_size": 16384, "hidden_size": 512, "intermediate_size": 1536, "num_layers": 8, "num_heads": 8,
          "num_kv_heads": 4, "head_dim": 64, "tie_word_embeddings": False}

SHAPES = {"small": (SMALL, 256), "medium": (MEDIUM, 512)}  # shape, max_seq_len
TECHNIQUES: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"adapter": {"rank": 16, "alpha": 32}},
    "qlora": {"adapter": {"rank": 16, "alpha": 32}, "memory": ["qlora_nf4"]},
    "ac": {"memory": ["activation_checkpointing"]},
}
#: GRPO's rollouts: 2 prompts x 4 completions per step, 192 prompt + 64 completion tokens, trained
#: 4 completions at a time (two micro-batches accumulated into one step): 4 x 256 tokens per
#: forward, SFT's small micro-batch. The prompt length is taken from ``max_seq_len`` of the shape.
GRPO = {"group_size": 4, "max_new_tokens": 64, "micro_batch_size": 4, "rewards": [{"name": "exact_answer"}]}
#: name -> (shape, technique, method); SFT's names carry no method
CONFIGS = {f"{shape}-{technique}": (shape, technique, "sft") for shape in SHAPES for technique in TECHNIQUES}
CONFIGS.update({f"{shape}-dpo-{technique}": (shape, technique, "dpo")
                for shape in SHAPES for technique in ("full", "lora")})
CONFIGS.update({f"small-grpo-{technique}": ("small", technique, "grpo") for technique in ("full", "lora")})


def text_rows(count: int, seq: int, seed: int = 0) -> list[dict[str, str]]:
    """Plain-text rows of random 5-letter words, each well over ``seq`` tokens (truncated to it)."""
    rng = random.Random(seed)
    return [{"text": " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(seq * 2))}
            for _ in range(count)]


def preference_rows(count: int, seq: int, seed: int = 0) -> list[dict[str, str]]:
    """A short prompt; chosen and rejected responses each well over ``seq`` tokens (cut to it)."""
    chosen, rejected = text_rows(count, seq, seed), text_rows(count, seq, seed + 1)
    return [{"prompt": f"Continue: {i}", "chosen": a["text"], "rejected": b["text"]}
            for i, (a, b) in enumerate(zip(chosen, rejected, strict=True))]


def prompt_rows(count: int, seq: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompts well over ``seq`` tokens (their last ``max_prompt_len`` kept), with an answer for exact_answer."""
    return [{"prompt": row["text"], "answer": "x"} for row in text_rows(count, seq, seed)]


def run_config(directory: Path, model: dict[str, Any], *, seq: int, batch: int = 4, steps: int = 3,
               method: str = "sft", **sections: Any) -> dict[str, Any]:
    """A run config of ``method`` whose every micro-batch is full (rows written to ``directory``).

    SFT and DPO: ``batch`` rows (pairs) of ``seq`` tokens. GRPO: ``batch // 2`` prompts of ``seq - 64``
    tokens, each completed 4 times with 64 new tokens (``GRPO``), ``max_seq_len`` set above the rows.
    """
    from run_support import TOKENIZER  # tests/run_support.py: the demo tokenizer's path

    directory.mkdir(parents=True, exist_ok=True)
    train = directory / "train.jsonl"
    data: dict[str, Any] = {"max_seq_len": seq}
    train_section: dict[str, Any] = {"batch_size": batch}
    if method == "sft":
        rows, fmt, method_section = text_rows(batch * steps + 2, seq), "text", "sft"
    elif method == "dpo":
        rows, fmt, method_section = preference_rows(batch * steps + 2, seq), "preference", {"name": "dpo"}
    elif method == "grpo":
        prompts = batch // 2  # x group_size 4 = 2 x batch completions per step, in micro-batches of 4
        rows, fmt = prompt_rows(prompts * steps + 2, seq), "prompt"
        method_section = {"name": "grpo", **GRPO}
        data = {"max_seq_len": 2 * seq, "max_prompt_len": seq - GRPO["max_new_tokens"]}
        train_section = {"batch_size": prompts,
                         "grad_accum_steps": prompts * GRPO["group_size"] // GRPO["micro_batch_size"]}
    else:
        raise ValueError(f"unknown method {method!r}")
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config: dict[str, Any] = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": model},
        "tokenizer": {"path": TOKENIZER},
        "method": method_section,
        "data": {"train": {"path": str(train), "format": fmt}, **data},
        "train": {"epochs": 1, "max_steps": steps, "lr": 1e-4, "seed": 0, "device": "cpu", **train_section},
        "checkpoint": {"output_dir": str(directory / "out")},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def measure(config: dict[str, Any], *, threads: int = 1) -> dict[str, Any]:
    """Train ``config`` in a fresh subprocess; its peak resident memory and tokens per step."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], capture_output=True, text=True,
                         check=False, env=env)
    if run.returncode != 0:
        raise SystemExit(f"training child failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def estimate_config(config: dict[str, Any]) -> Any:
    from posttune.config import validate
    from posttune.estimate import estimate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    return estimate(resolve_plan(validate(config), get_registry()))


def compare(name: str, config: dict[str, Any]) -> dict[str, Any]:
    measured = measure(config)
    est = estimate_config(config)
    return {
        "config": name,
        "parameters": est.parameters,
        "trainable": est.trainable,
        "tokens_per_micro_batch": est.tokens,
        "measured_tokens_per_step": measured["tokens_per_step"],
        "estimate_mib": round(est.total / MIB, 1),
        "measured_mib": round(measured["peak"] / MIB, 1),
        "ratio": round(est.total / measured["peak"], 3),
        "setup_peak_mib": round(measured["setup_peak"] / MIB, 1),
        "components_mib": {key: round(value / MIB, 1) for key, value in est.components().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (state exists from step 2)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            shape, technique, method = CONFIGS[name]
            model, seq = SHAPES[shape]
            config = run_config(Path(tmp) / name, model, seq=seq, steps=args.steps, method=method,
                                **TECHNIQUES[technique])
            result = compare(name, config)
            results.append(result)
            print(f"{name}: estimate {result['estimate_mib']} MiB, measured {result['measured_mib']} MiB, "
                  f"ratio {result['ratio']}", file=sys.stderr)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
