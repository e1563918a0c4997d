"""`posttune generate`: complete prompts with a checkpoint, KV-cached, greedy by default.

The checkpoint (and ``--adapter``) and its tokenizer load through the core, as a run's do; several
``--prompt``s are completed together in one batch by this distribution's engine ``builtin``
(KV-cached, left-padded) through ``posttune.plugin.complete``; each completion is printed under a
``=== [i/n] prompt`` header, in order. One prompt prints its completion alone.

Every option is checked before the model loads (one line, exit 2, naming the option); the
sampling ranges are ``check_sampling``'s, the same GRPO and KD generate with. A prompt that
leaves no room in the model's context is refused, not truncated: cutting either end changes the
question silently. ``--max-new-tokens`` past the context is capped, with one warning line on
stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttune.plugin import Command, dtype_argument

#: the engine that completes the prompts: this distribution's own, registered under this name
ENGINE = "builtin"
#: the sampling settings' options, which do nothing when decoding is greedy
SAMPLING_OPTIONS = {"top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "seed": "--seed"}
#: how to turn a filter off, for the message refusing a value out of range
OFF = {"top_k": "leave --top-k out to keep every token", "top_p": "1 or leaving it out keeps every token",
       "min_p": "0 or leaving it out keeps every token", "temperature": "0 is greedy"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory or hub id (default with --adapter: the base model "
                                         "its adapter_config.json names)")
    parser.add_argument("--prompt", required=True, action="append",
                        help="the text to complete; repeat it to complete several prompts in one batch")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    parser.add_argument("--tools", metavar="FILE", help="with --chat: a JSON file holding a list of tool definitions "
                                                        "(JSON schemas), given to the chat template as `tools`")
    parser.add_argument("--chat-template-kwargs", metavar="JSON",
                        help="with --chat: variables for the chat template, e.g. '{\"enable_thinking\": false}' (a "
                             "run's tokenizer.chat_template_kwargs)")
    parser.add_argument("--adapter", type=os.path.expanduser,
                        help="a PEFT adapter directory to apply on top of the model")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens to generate at most, >= 1 (default 128; capped to the model's context)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature, >= 0; 0 means "
                                                                        "greedy (the default)")
    parser.add_argument("--top-k", type=int, default=None, help="with --temperature: sample among the K most likely "
                                                                "tokens, K >= 1")
    parser.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling, P in (0, 1]")
    parser.add_argument("--min-p", type=float, default=None, help="with --temperature: keep tokens with p >= MIN_P x "
                                                                  "the top p, MIN_P in [0, 1]")
    parser.add_argument("--seed", type=int, default=None,
                        help="with --temperature: the run seed (any integer); each prompt draws from its own stream, "
                             "seeded by this and its place in the list (as a training run's rows)")
    parser.add_argument("--dtype", default=None, type=dtype_argument,
                        help="bf16, bfloat16, fp16, fp32 ... (default: the checkpoint's own)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1 ...")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")


def run(args: argparse.Namespace) -> int:
    import torch

    from posttune.plugin import (
        Sampling,
        check_causal,
        check_fits,
        complete,
        context_length,
        derive_seed,
        first_line,
        load_adapter,
        load_model,
        load_tokenizer,
        tokenizer_source,
        warn_of_other_base,
    )

    check_options(args)
    tools = read_tools(args.tools)
    template_kwargs = read_template_kwargs(args.chat_template_kwargs)
    base = args.model or adapter_base(args.adapter)
    if args.adapter and args.model:
        warn_of_other_base("generate", args.adapter, args.model)
    check_causal(base, "generate: --model")
    model = load_model(base, dtype=args.dtype, device=device_of(args.device))
    if args.adapter:
        load_adapter(model, args.adapter)
    tokenizer = load_tokenizer(tokenizer_source(base, args.adapter))
    check_fits(tokenizer, model, "--model")
    tokenizer.template_kwargs = template_kwargs
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if args.chat and tools is not None:
        tokenizer.check_tool_use([{"role": "user", "content": args.prompt[0]}], tools)
    prompts = [tokenizer.apply_chat_template([*system, {"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tools=tools)
               if args.chat else tokenizer.encode(prompt) for prompt in args.prompt]
    max_new_tokens = fit_prompts(context_length(model), prompts, args.max_new_tokens)
    sampling = Sampling(max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p, stop_token_ids=tokenizer.eos_ids)
    seeds = None if args.seed is None else [derive_seed(args.seed, row) for row in range(len(prompts))]
    with torch.no_grad():
        out = complete(model.eval(), prompts, sampling, seeds=seeds, engine=ENGINE, where="generate")
    for index, (prompt, new) in enumerate(zip(args.prompt, out.token_lists(), strict=True)):
        if len(args.prompt) > 1:
            print(f"=== [{index + 1}/{len(args.prompt)}] {first_line(prompt)}")
        print(tokenizer.decode(new, skip_special_tokens=True))
        if args.show_ids:
            print(" ".join(map(str, new)))
    return 0


def check_options(args: argparse.Namespace) -> None:
    """Refuse what cannot run as asked, before the model loads: one line naming the option."""
    from posttune.plugin import PosttuneError, SamplingError, check_sampling

    if args.system is not None and not args.chat:
        raise PosttuneError("generate: --system needs --chat (a system message is a turn of the chat template)")
    if args.tools is not None and not args.chat:
        raise PosttuneError("generate: --tools needs --chat (the chat template renders the tool definitions)")
    if args.chat_template_kwargs is not None and not args.chat:
        raise PosttuneError("generate: --chat-template-kwargs needs --chat (they are the chat template's variables)")
    if args.max_new_tokens < 1:
        raise PosttuneError(f"generate: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        check_sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    except SamplingError as error:
        option = "--" + error.name.replace("_", "-")
        raise PosttuneError(f"generate: {option} must be {error.allowed}, got {error.value} ({OFF[error.name]})"
                            ) from None
    given = [option for name, option in SAMPLING_OPTIONS.items() if getattr(args, name) is not None]
    if given and args.temperature == 0:
        raise PosttuneError(f"generate: {given[0]} only applies when sampling: add --temperature above 0 "
                            f"(the default, 0, is greedy)")


def read_tools(path: str | None) -> list[dict] | None:
    """``--tools FILE``'s tool definitions, checked as a dataset row's ``tools`` are; one line naming the file."""
    if path is None:
        return None
    import json
    from pathlib import Path

    from posttune.plugin import PosttuneError, row_tools

    try:
        return row_tools({"tools": json.loads(Path(path).read_text(encoding="utf-8"))})
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json's errors are ValueErrors too
        raise PosttuneError(f"generate: --tools {path}: {exc}") from None


def read_template_kwargs(text: str | None) -> dict:
    """``--chat-template-kwargs``: a JSON object of template variables, none of those a render sets itself."""
    if text is None:
        return {}
    import json

    from posttune.plugin import RENDER_VARIABLES, PosttuneError

    try:
        variables = json.loads(text)
    except ValueError as exc:
        raise PosttuneError(f"generate: --chat-template-kwargs: not JSON ({exc})") from None
    if not isinstance(variables, dict):
        raise PosttuneError(f"generate: --chat-template-kwargs: expected a JSON object, got {text}")
    for name in variables:
        if name in RENDER_VARIABLES:
            raise PosttuneError(f"generate: --chat-template-kwargs: {name} is set by the render itself")
    return variables


def fit_prompts(context: int | None, prompts: list[list[int]], max_new_tokens: int) -> int:
    """``max_new_tokens``, capped (with one warning line) so every prompt and its completion fit the
    model's ``context`` (None: unknown, no cap). A prompt of no tokens, or one that leaves no room for a new token,
    is refused."""
    from posttune.plugin import PosttuneError

    for index, ids in enumerate(prompts):
        which = f"--prompt {index + 1} of {len(prompts)}" if len(prompts) > 1 else "--prompt"
        if not ids:
            raise PosttuneError(f"generate: {which} is empty: it has no tokens to complete")
        if context is not None and len(ids) >= context:
            raise PosttuneError(f"generate: {which} is {len(ids)} tokens, which leaves no room for a new token in "
                                f"the model's context of {context} (max_position_embeddings): shorten it "
                                f"(prompts are never truncated)")
    longest = max(len(ids) for ids in prompts)
    if context is None or max_new_tokens <= context - longest:
        return max_new_tokens
    which = "the longest prompt" if len(prompts) > 1 else "the prompt"
    print(f"posttune: warning: generate: --max-new-tokens {max_new_tokens} capped to {context - longest}: {which} "
          f"({longest} tokens) and its completion must fit the model's context of {context} tokens "
          f"(max_position_embeddings)", file=sys.stderr)
    return context - longest


def adapter_base(adapter: str | None) -> str:
    """The base model an adapter directory names (``base_model_name_or_path``), for ``--adapter`` alone."""
    from posttune.plugin import PosttuneError
    from posttune.plugin import adapter_base as named_base

    if not adapter:
        raise PosttuneError("generate: give --model, or --adapter with an adapter_config.json naming its base model")
    return named_base(adapter, "generate")


def device_of(name: str | None) -> str:
    """``auto``: CUDA when a GPU is there, else the CPU (as `train.device: auto` does)."""
    from posttune.plugin import device_for

    return device_for(name, "generate: --device")


COMMAND = Command("generate", "complete prompts with a checkpoint (KV cache; greedy unless --temperature)",
                  configure, run, examples=(
                      'posttune generate --model runs/demo/model --chat --prompt "Reverse: KERNEL"',
                      'posttune generate --adapter runs/lora/adapter --prompt "Hello" --max-new-tokens 32'))
