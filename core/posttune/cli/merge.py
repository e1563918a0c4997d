"""`posttune merge`: fold a saved adapter (LoRA/DoRA, or any installed kind's) into its base model and save a
plain HF checkpoint.

The merged folder needs neither PEFT nor posttune to load (``AutoModelForCausalLM``, vLLM, llama.cpp's
converters); it is what ``checkpoint.save_merged`` writes at the end of a run, for an adapter saved
without it, or trained under a sharding plan (FSDP2, TP), where the run refuses to merge (see docs/parallel.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from posttune.checkpoint.peft_config import ADAPTER_CONFIG, inside, warn_of_other_base
from posttune.cli.options import dtype_argument
from posttune.descriptors import Command
from posttune.errors import PosttuneError, one_line

EXAMPLES = ("posttune merge --adapter runs/lora/adapter -o runs/lora/merged",
            "posttune merge --adapter runs/lora/adapter --model models/llama-1b --dtype bf16 -o merged")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapter", required=True, type=os.path.expanduser,
                        help="a saved adapter directory (adapter_config.json; LoRA/DoRA or another installed kind)")
    parser.add_argument("--model", help="the base checkpoint directory or hub id (default: the base model the "
                                         "adapter's adapter_config.json names)")
    parser.add_argument("-o", "--output", required=True, help="the folder to write (new or empty)")
    parser.add_argument("--dtype", default=None, type=dtype_argument,
                        help="bf16, bfloat16, fp16, fp32 ... (default: the base checkpoint's own)")
    parser.add_argument("--max-shard-size", default=None, help='largest safetensors file, e.g. "2GB" (default 5GB)')


def run(args: argparse.Namespace) -> int:
    from posttune.adapters import adapter_base, load_adapter, merge_adapters, tokenizer_source
    from posttune.api import load_model, load_tokenizer, save_model

    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PosttuneError(f"merge: -o {out} exists and is not an empty directory; choose a new one")
    if not (Path(args.adapter) / ADAPTER_CONFIG).is_file():
        raise PosttuneError(f"merge: --adapter {args.adapter}: no {ADAPTER_CONFIG} there"
                            f"{inside(args.adapter, ADAPTER_CONFIG)}")
    base = args.model or adapter_base(args.adapter, "merge")
    if args.model:
        warn_of_other_base("merge", args.adapter, args.model, "; the merged model is that base plus this update")
    model = load_model(base, device="cpu")  # in its own dtype; each merged weight rounds once to --dtype
    merged = load_adapter(model, args.adapter)
    merge_adapters(model, dtype=args.dtype)
    if args.dtype is not None:
        model.to(args.dtype)  # the weights no adapter changed: only cast
    try:
        tokenizer = load_tokenizer(tokenizer_source(base, args.adapter))
    except PosttuneError as exc:  # weights-only base: the merged weights are still the point
        tokenizer = None
        print(f"merge: no tokenizer copied ({one_line(str(exc))})")
    save_model(model, out, tokenizer=tokenizer, max_shard_size=args.max_shard_size)
    print(f"merged {args.adapter} ({len(merged)} adapted layers) with its base {base} (left as it was): wrote {out}")
    return 0


COMMAND = Command("merge", "fold a PEFT LoRA/DoRA adapter into its base model and save a plain HF checkpoint",
                  configure, run, examples=EXAMPLES)
