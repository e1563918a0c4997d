"""posttune-lmeval: `posttune eval`, lm-evaluation-harness tasks scored with posttune's own forward.

    pip install -c constraints.txt ./plugins/generate ./plugins/lmeval
    posttune eval --model runs/sft/model --tasks arc_easy,hellaswag --limit 200 --output eval.json
    posttune eval --adapter runs/lora/adapter --tasks my_task --include-path tasks/ --apply-chat-template

The command loads a checkpoint (or a base plus a PEFT adapter) with ``posttune.plugin.load_model``
and hands lm-eval a ``PosttuneLM`` (model.py): the harness builds prompts and computes metrics,
posttune computes log-likelihoods and greedy completions, and with ``--apply-chat-template`` renders
lm-eval's chat messages with the checkpoint's own template (chat.py). The scores equal lm-eval's
Hugging Face wrapper's on the same weights (docs/eval.md says where and why they could differ).

Importing this module imports neither torch nor lm_eval (`posttune --help` stays fast).
"""

from __future__ import annotations

from posttune import hookimpl
from posttune.plugin import Command

from posttune_lmeval import command

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

EXAMPLES = (
    "posttune eval --model runs/sft/model --tasks arc_easy,hellaswag --limit 200 --output eval.json",
    "posttune eval --adapter runs/lora/adapter --tasks my_task --include-path tasks/ --num-fewshot 3 "
    "--apply-chat-template",
)


@hookimpl
def posttune_register_commands(cli):
    cli(Command("eval", "score a checkpoint or adapter on lm-evaluation-harness tasks (posttune's forward; "
                                 "the same numbers as lm-eval's HF model)", command.configure, command.run,
                examples=EXAMPLES))
