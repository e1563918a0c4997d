"""Chat templates for `posttune eval --apply-chat-template`: lm-eval's chat messages rendered as text.

lm-eval builds each prompt as chat messages (a system instruction, few-shot examples as
user/assistant turns or folded into one user turn, the question as the last user turn) and
asks the model to render them (``LM.apply_chat_template``). Here the checkpoint's own template
renders them through the posttune tokenizer (``Tokenizer.apply_chat_template``, the renderer
`posttune generate --chat` and SFT use), which gives the text transformers gives, so the
prompts are the ones lm-eval's Hugging Face model builds.

Two lm-eval details are reproduced here because the tokenizer does not offer them:

- a task with a ``gen_prefix`` ends on an assistant message that the model continues, which
  transformers renders with ``continue_final_message=True`` (the text up to the end of that
  message, without the template's end-of-turn);
- a template that rejects a system message is rendered again without it, with a warning, as
  lm-eval's HFLM does (its templates: Gemma 1, old Mistral).

Importing this module imports neither torch nor lm_eval (the command checks a template before
anything heavy is loaded).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from posttune.plugin import PosttuneError, did_you_mean

log = logging.getLogger(__name__)

#: appended to the message being continued, to find where that message ends in the rendered text
CONTINUE_MARK = "POSTTUNE_EVAL_CONTINUE_FROM_HERE "
#: the key, in a model's set of warnings given, of "the system message was left out"
DROPPED_SYSTEM = "<chat: system message left out>"


def template_source(tokenizer: Any, name: str | None, where: str) -> str:
    """The Jinja source of the template ``--apply-chat-template [NAME]`` asks for, or a one-line error.

    ``name`` None takes the tokenizer's only template, or its ``default`` one among several named
    ones (transformers' rule); a name must be one of the named templates (``chat_template.jinja``
    is ``default``, ``additional_chat_templates/NAME.jinja`` the others).
    """
    templates = tokenizer.chat_template
    if not templates:
        raise PosttuneError(f"eval: --apply-chat-template: {where} has no chat template (no chat_template.jinja, no "
                            f"'chat_template' in tokenizer_config.json); evaluate it without --apply-chat-template")
    if isinstance(templates, str):
        if name not in (None, "default"):
            raise PosttuneError(f"eval: --apply-chat-template {name}: {where} has a single chat template, not named "
                                f"ones; give --apply-chat-template alone")
        return templates
    chosen = name or "default"
    if chosen not in templates:
        hint = did_you_mean(chosen, templates) or f" (its templates: {', '.join(sorted(templates))})"
        if name is None:
            raise PosttuneError(f"eval: --apply-chat-template: {where} has named chat templates and none is 'default'; "
                                f"name one: --apply-chat-template NAME{hint}")
        raise PosttuneError(f"eval: --apply-chat-template {name}: {where} has no chat template '{name}'{hint}")
    return templates[chosen]


def with_template(tokenizer: Any, source: str) -> Any:
    """A view of ``tokenizer`` whose chat template is ``source`` (one of its named ones); the rest is shared."""
    view = copy.copy(tokenizer)
    view.chat_template = source
    return view


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
           warned: set[str] | None = None) -> str:
    """``messages`` rendered by the tokenizer's template: ending on the assistant header when
    ``add_generation_prompt``, else continuing the last (assistant) message, as lm-eval's HFLM asks
    transformers to. A template that rejects a system message is retried without it (warned once)."""
    try:
        return _render(tokenizer, messages, add_generation_prompt)
    except PosttuneError:
        if not any(message.get("role") == "system" for message in messages):
            raise
        kept = [message for message in messages if message.get("role") != "system"]
        if warned is not None and DROPPED_SYSTEM not in warned:
            log.warning("the chat template of %s rejects a system message: the system instruction is left out "
                        "(as lm-eval's HF model does)", tokenizer.source)
            warned.add(DROPPED_SYSTEM)
        return _render(tokenizer, kept, add_generation_prompt)


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    if add_generation_prompt:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    # Continue the final message: mark its end, render, cut at the mark. A template that trims the
    # content (`| trim`) eats the mark's trailing space; then trailing whitespace goes too, as in
    # transformers (the message's own trailing space is trimmed by such a template anyway).
    final = str(messages[-1].get("content", ""))
    marked = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_MARK}]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=False, tokenize=False)
    at = text.rfind(CONTINUE_MARK.strip())
    if at < 0 or final.strip() not in text:
        raise PosttuneError(f"eval: the chat template of {tokenizer.source} drops part of the assistant prefix "
                            f"{final!r} that the task asks the model to continue (the task's gen_prefix)")
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()
