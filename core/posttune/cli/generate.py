"""`posttune generate`: complete prompts with a checkpoint, KV-cached, greedy by default.

Several ``--prompt``s are completed together in one left-padded batch (``generate_batch``);
each completion is printed under a ``=== [i/n] prompt`` header, in order. One prompt prints
its completion alone, as before.
"""

from __future__ import annotations

import argparse

from posttune.descriptors import Command


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory or hub id (default with --adapter: the base model "
                                         "its adapter_config.json names)")
    parser.add_argument("--prompt", required=True, action="append",
                        help="the text to complete; repeat it to complete several prompts in one batch")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    parser.add_argument("--adapter", help="a PEFT adapter directory to apply on top of the model")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None, help="keep tokens with p >= MIN_P x the top p")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="bf16, bfloat16, fp16, fp32 ... (default: the checkpoint's own)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1 ...")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")


def run(args: argparse.Namespace) -> int:
    import torch

    from posttune.api import load_model, load_tokenizer
    from posttune.errors import PosttuneError, first_line
    from posttune.generation import generate_batch

    if args.system is not None and not args.chat:
        raise PosttuneError("generate: --system needs --chat (a system message is a turn of the chat template)")
    base = args.model or adapter_base(args.adapter)
    model = load_model(base, dtype=args.dtype, device=device_of(args.device))
    if args.adapter:
        from posttune.adapters import load_peft_adapter

        load_peft_adapter(model, args.adapter)
    tokenizer = load_tokenizer(base)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompts = [tokenizer.apply_chat_template([*system, {"role": "user", "content": prompt}], add_generation_prompt=True)
               if args.chat else tokenizer.encode(prompt) for prompt in args.prompt]
    with torch.no_grad():
        out = generate_batch(model.eval(), prompts, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                             seed=args.seed, stop_token_ids=tokenizer.eos_ids)
    for index, (prompt, new) in enumerate(zip(args.prompt, out.token_lists(), strict=True)):
        if len(args.prompt) > 1:
            print(f"=== [{index + 1}/{len(args.prompt)}] {first_line(prompt)}")
        print(tokenizer.decode(new, skip_special_tokens=True))
        if args.show_ids:
            print(" ".join(map(str, new)))
    return 0


def adapter_base(adapter: str | None) -> str:
    """The base model an adapter directory names (``base_model_name_or_path``), for ``--adapter`` alone."""
    from posttune.adapters import adapter_base as named_base
    from posttune.errors import PosttuneError

    if not adapter:
        raise PosttuneError("generate: give --model, or --adapter with an adapter_config.json naming its base model")
    return named_base(adapter, "generate")


def device_of(name: str | None) -> str:
    """``auto``: CUDA when a GPU is there, else the CPU (as `train.device: auto` does)."""
    if name in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


COMMAND = Command("generate", "complete prompts with a checkpoint (KV cache; greedy unless --temperature)",
                  configure, run)
