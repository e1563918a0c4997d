"""`posttune eval`: score a checkpoint or an adapter on lm-evaluation-harness tasks.

    posttune eval --model runs/sft/model --tasks hellaswag,arc_easy --limit 200
    posttune eval --adapter runs/lora/adapter --tasks my_task --include-path tasks/ --output eval.json

Every argument is checked, and every task name looked up, before a weight is loaded: a typo
costs seconds, not a model load. Importing this module imports neither torch nor lm_eval
(`posttune --help` stays fast); `run` does.

``--apply-chat-template [NAME]``, ``--system-instruction TEXT`` and ``--(no-)fewshot-as-multiturn``
are lm-eval's ``apply_chat_template``, ``system_instruction`` and ``fewshot_as_multiturn``, with
lm-eval 0.4's defaults: few-shot examples become chat turns whenever a template is applied.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from posttune.plugin import PosttuneError, did_you_mean

DEVICES = ("auto", "cpu", "cuda")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory or hub id (default with --adapter: the base model "
                                         "its adapter_config.json names)")
    parser.add_argument("--adapter", help="a PEFT LoRA/DoRA adapter directory to apply on top of the model")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task, group or tag names (glob patterns allowed: mmlu_*)")
    parser.add_argument("--include-path", help="a directory of extra task YAMLs (local tasks)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="requests per forward pass (default 8); scores do not depend on it")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task: N, or a fraction < 1 (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=None,
                        help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, "
                                                          "cuda:1 ... (default auto)")
    parser.add_argument("--dtype", default=None, help="bf16, fp16, fp32 ... (default: the checkpoint's own)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="context length in tokens (default: config.json's max_position_embeddings)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for few-shot sampling, document order and sampled generation "
                             "(default: lm-eval's seeds, 0 and 1234)")
    parser.add_argument("--apply-chat-template", nargs="?", const=True, default=False, metavar="NAME",
                        help="render each prompt as a chat with the tokenizer's chat template (instruct/chat models); "
                             "NAME picks one of its named templates (default: its default one)")
    parser.add_argument("--system-instruction", metavar="TEXT",
                        help="a system message before each prompt (without --apply-chat-template: text put before "
                             "the prompt)")
    parser.add_argument("--fewshot-as-multiturn", action=argparse.BooleanOptionalAction, default=None,
                        help="few-shot examples as user/assistant turns (the default with --apply-chat-template); "
                             "--no-fewshot-as-multiturn puts them all in one user turn")
    parser.add_argument("--output", "-o", help="write the results as JSON to this file (default: print only)")
    parser.add_argument("--log-samples", action="store_true",
                        help="include each document's prompt, responses and scores in --output")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from posttune.plugin import adapter_base, check_causal

    from posttune_lmeval.chat import template_source

    base = args.model or adapter_base(args.adapter, "eval")
    if Path(base).expanduser().is_dir():  # an adapter or a run's folder given as --model, a reward model: one line
        check_causal(base, "eval: --model")
    template = args.apply_chat_template if isinstance(args.apply_chat_template, str) else None
    tokenizer = None
    if args.apply_chat_template is not False:  # a checkpoint without that template: one line, in a second
        tokenizer = model_tokenizer(base, args)
        template_source(tokenizer, template, base)
    import logging

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from posttune_lmeval.model import PosttuneLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = TaskManager(include_path=args.include_path)
    tasks = task_names(args.tasks, manager)
    tokenizer = tokenizer or model_tokenizer(base, args)
    lm = PosttuneLM(load(base, args.adapter, args.dtype, args.device), tokenizer, batch_size=args.batch_size,
                    max_length=args.max_length, seed=0 if args.seed is None else args.seed, chat_template=template)
    seeds = {} if args.seed is None else {name: args.seed for name in (
        "random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")}
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    chat_options = prompt_options(args)
    try:
        results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot,
                                  limit=limit, log_samples=args.log_samples, **chat_options, **seeds)
    except Exception as exc:  # a hub task without its data in the cache: one line, not lm-eval's traceback
        if not unreachable(exc):
            raise
        line = " ".join(str(exc).split())[:300]
        raise PosttuneError(f"eval: a task's dataset could not be read ({type(exc).__name__}: {line}); a hub task "
                            "runs only with its data in the datasets cache (run it once online) or network access; "
                            "a local task (--include-path) needs neither") from None
    results.update(prompt_record(lm, chat_options))
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        write_json(results, Path(args.output), samples=args.log_samples)
        print(f"results written to {args.output}")
    return 0


def unreachable(exc: BaseException) -> bool:
    """The hub could not be reached for a task's data (offline mode, no network): datasets', huggingface_hub's
    and requests' spellings of it."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, ConnectionError) or bool(names & {"ConnectionError", "OfflineModeIsEnabled",
                                                             "LocalEntryNotFoundError", "DatasetNotFoundError"})


def model_tokenizer(base: str, args: argparse.Namespace) -> Any:
    """The tokenizer beside the model (or the adapter's own); a local ``--model`` that is not there is named as
    such, not as a tokenizer folder."""
    from posttune.plugin import load_tokenizer, tokenizer_source

    local = base.startswith((".", "/", "~")) or base.count("/") != 1  # a hub id is owner/name
    if args.model and local and not Path(base).expanduser().is_dir():
        raise PosttuneError(f"eval: --model {base}: no such checkpoint directory")
    return load_tokenizer(tokenizer_source(base, args.adapter))


def check_arguments(args: argparse.Namespace) -> None:
    """One line per mistake, before anything heavy is imported or loaded."""
    if not args.model and not args.adapter:
        raise PosttuneError("eval: give --model, or --adapter with an adapter_config.json naming its base model")
    if not [name for name in args.tasks.split(",") if name.strip()]:
        raise PosttuneError("eval: --tasks: name at least one task (e.g. --tasks hellaswag,arc_easy)")
    if args.batch_size < 1:
        raise PosttuneError(f"eval: --batch-size must be >= 1, got {args.batch_size}")
    if args.limit is not None and (args.limit <= 0 or args.limit >= 1 and args.limit != int(args.limit)):
        raise PosttuneError(f"eval: --limit must be a whole number of documents or a fraction in (0, 1), "
                            f"got {args.limit:g}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise PosttuneError(f"eval: --num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.max_length is not None and args.max_length < 2:
        raise PosttuneError(f"eval: --max-length must be >= 2, got {args.max_length}")
    if args.device.split(":")[0] not in DEVICES:
        raise PosttuneError(f"eval: --device must be one of auto, cpu, cuda, cuda:N; got {args.device!r}")
    if args.include_path and not Path(args.include_path).is_dir():
        raise PosttuneError(f"eval: --include-path {args.include_path}: no such directory")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise PosttuneError(f"eval: --output {args.output}: directory {Path(args.output).parent} does not exist")
    if args.adapter and not Path(args.adapter).is_dir():
        raise PosttuneError(f"eval: --adapter {args.adapter}: no such directory")
    if args.apply_chat_template == "":
        raise PosttuneError("eval: --apply-chat-template: give a template name, or the option alone for the default")
    if args.system_instruction is not None and not args.system_instruction.strip():
        raise PosttuneError("eval: --system-instruction: the text is empty")
    if args.fewshot_as_multiturn and args.apply_chat_template is False:
        raise PosttuneError("eval: --fewshot-as-multiturn needs --apply-chat-template (few-shot turns are chat "
                            "messages; without a template the examples are plain text)")


def prompt_options(args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval's prompt-formatting arguments; few-shot examples are turns whenever a template is applied
    (lm-eval 0.4's rule), unless --no-fewshot-as-multiturn."""
    applied = args.apply_chat_template is not False
    multiturn = applied if args.fewshot_as_multiturn is None else args.fewshot_as_multiturn
    return {"apply_chat_template": args.apply_chat_template, "system_instruction": args.system_instruction,
            "fewshot_as_multiturn": multiturn}


def prompt_record(lm: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The prompt settings as lm-eval's own CLI writes them into its results (with the template's source
    and hashes), so a results file says how its prompts were made."""
    from lm_eval.utils import hash_string

    source = lm.chat_template(options["apply_chat_template"])
    instruction = options["system_instruction"]
    return {"chat_template": source, "chat_template_sha": hash_string(source) if source else None,
            "system_instruction": instruction,
            "system_instruction_sha": hash_string(instruction) if instruction else None,
            "fewshot_as_multiturn": options["fewshot_as_multiturn"]}


def task_names(spec: str, manager: Any) -> list[str]:
    """``a,b,mmlu_*`` -> the task, group and tag names lm-eval knows; an unknown one is a one-line error."""
    known = set(manager.all_tasks)
    names = []
    for name in (part.strip() for part in spec.split(",")):
        matched = [name] if name in known else manager.match_tasks([name]) if name else []
        if not matched:
            hint = did_you_mean(name, known) or " (see `lm-eval ls tasks`; local YAMLs: --include-path)"
            raise PosttuneError(f"eval: --tasks: no task '{name}'{hint}")
        names += [m for m in matched if m not in names]
    return names


def load(base: str, adapter: str | None, dtype: str | None, device: str) -> Any:
    """The base checkpoint's model, with the adapter's LoRA/DoRA layers when one is given."""
    import torch
    from posttune.plugin import load_adapter, load_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise PosttuneError(f"eval: --device {device}: no CUDA device is available")
    model = load_model(base, dtype=dtype, device=device)
    if adapter:
        load_adapter(model, adapter)
    return model.eval()


def write_json(results: dict, path: Path, *, samples: bool) -> None:
    from lm_eval.utils import handle_non_serializable

    kept = {key: value for key, value in results.items() if samples or key != "samples"}
    path.write_text(json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n",
                    encoding="utf-8")
