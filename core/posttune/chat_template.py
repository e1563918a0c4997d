"""Render a checkpoint's own Jinja chat template exactly as transformers does, and find its assistant turns.

Chat templates are untrusted code from the hub, so they run in jinja2's immutable sandbox with the
same options and helpers transformers gives them (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a non-escaping ``tojson``, ``{% generation %}`` blocks,
loop controls): a template renders here to the very string ``apply_chat_template`` renders, so a
model is trained on the text it will be prompted with.

Rendering is bounded in time and size (`posttune.template_limits`): a template that loops
without end or builds gigabytes stops with a one-line `TemplateLimitError` naming its file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from posttune.errors import PosttuneError
from posttune.template_limits import (
    LimitedSandbox,
    LimitedTemplate,
    RenderLimits,
    TemplateLimitError,
    compile_limited,
    read_limits,
)

ROLES = ("assistant", "developer", "ipython", "system", "tool", "user")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names templates read reasoning under

# Noncharacters mark where {% generation %} output starts and ends; they never occur in real text.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_marking: ContextVar[bool] = ContextVar("posttune_marking_generation", default=False)

Span = tuple[int, int]


class TemplateRaised(jinja2.TemplateError):
    """What ``raise_exception(...)`` in a template throws, told apart from template bugs."""


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the template's own marking of trainable text (TRL)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        text = caller()
        return f"{_OPEN}{text}{_CLOSE}" if _marking.get() else text


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold {name!r}")


class _DictMaker:
    """``dict(...)`` without exposing the ``dict`` type itself to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (< becomes \u003c); templates expect plain JSON, as transformers gives.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def environment() -> LimitedSandbox:
    return LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
                          extra_filters={"tojson": _tojson},
                          extra_globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now,
                                         "dict": _DictMaker(), "namespace": _Namespace})


@lru_cache(maxsize=32)
def _compiled(source: str) -> LimitedTemplate:
    return compile_limited(environment(), source)


def compile_template(source: str, where: str) -> LimitedTemplate:
    """The compiled template; a syntax error names the file it came from."""
    try:
        return _compiled(source)
    except jinja2.TemplateSyntaxError as exc:
        raise PosttuneError(f"chat template in {where}: line {exc.lineno}: {exc.message}") from None
    except RecursionError:
        raise PosttuneError(f"chat template in {where}: nested too deeply to compile") from None


def select_template(templates: str | Mapping[str, str], *, tools: Any, where: str) -> str:
    """One template out of a checkpoint's named ones: ``tool_use`` when tools are given, else ``default``."""
    if isinstance(templates, str):
        return templates
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise PosttuneError(f"chat templates in {where} have no 'default' among "
                        f"{', '.join(sorted(templates))}: name one 'default'")


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles, drop ``None`` fields and alias reasoning names, as transformers does before rendering.

    Dropping ``None`` matters: OpenAI-style data carries ``content=None`` or ``tool_calls=None``,
    which templates render as the text "None" but handle well when the key is absent.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PosttuneError("chat messages must be a non-empty list of {'role', 'content'} objects")
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PosttuneError(f"chat message {index}: expected an object with 'role' and 'content', "
                                f"got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise PosttuneError(f"chat message {index}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def check_tool_use(source: str, messages: Sequence[Mapping[str, Any]], tools: Any, where: str) -> None:
    """Tool definitions or tool calls given to a template that never reads them would vanish from the text the
    model trains on without a word: refused instead, naming what the template leaves out. ``messages`` as given
    or prepared: a null or empty ``tool_calls`` holds nothing to leave out."""
    calls = any(isinstance(message, Mapping) and message.get("tool_calls") for message in messages)
    for given, name, what in ((tools, "tools", "the tool definitions"), (calls, "tool_calls", "the tool calls")):
        if given and not re.search(rf"\b{name}\b", source):
            raise PosttuneError(f"the chat template in {where} never reads `{name}`, so {what} would be left out "
                                "of the text; use a template that renders them (tokenizer.chat_template)")


#: what `render` gives every template from the row and the call: not a caller's extra variable
RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "documents")


def render(source: str, messages: list[dict[str, Any]], *, where: str, add_generation_prompt: bool = False,
           tools: Any = None, variables: Mapping[str, Any] | None = None, limits: RenderLimits | None = None) -> str:
    """The rendered chat text. ``variables`` are the special tokens and the caller's extra template kwargs.

    Whatever goes wrong inside the template is one line naming ``where`` (the template's file):
    a limit (`TemplateLimitError`; ``limits`` defaults to the environment's), ``raise_exception``,
    or any error jinja2 or Python raise.
    """
    template = compile_template(source, where)
    limits = limits or read_limits()
    context = {"documents": None, **(variables or {}), "messages": messages, "tools": tools,
               "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(context, limits)
    except TemplateLimitError as exc:
        raise TemplateLimitError(f"chat template in {where}: {exc}") from None
    except TemplateRaised as exc:
        raise PosttuneError(f"chat template in {where} rejected the messages: {_one_line(exc)}") from None
    except Exception as exc:  # jinja2's errors, the sandbox's (range too big), Python's (1/0, 'a' + 1)
        raise PosttuneError(f"chat template in {where} failed: {type(exc).__name__}: {_one_line(exc)}") from None


def render_generation_spans(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[Span]]:
    """Render with the template's ``{% generation %}`` blocks located: (text, [(start, end), ...])."""
    token = _marking.set(True)
    try:
        marked = render(source, messages, **kwargs)
    finally:
        _marking.reset(token)
    text, spans, opened = [], [], []
    length = 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if piece == _OPEN:
            opened.append(length)
        elif piece == _CLOSE:
            spans.append((opened.pop(), length))
        else:
            text.append(piece)
            length += len(piece)
    return "".join(text), sorted(spans)


def has_generation_blocks(source: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


def assistant_spans(render_prefix: Callable[[list[dict[str, Any]], bool], str | None],
                    messages: list[dict[str, Any]], text: str, end_tokens: Sequence[str]) -> list[Span]:
    """Where each assistant turn lies in ``text`` (the whole rendered chat): its content and end-of-turn token.

    A turn starts where the conversation before it, rendered with the generation prompt, stops
    agreeing with the whole chat: the prompt the model will see at inference is not trained on,
    whatever the model writes after it is. A turn ends where the conversation up to and including
    it stops agreeing with the whole chat, less trailing whitespace, so the end-of-turn token the
    template writes after the content (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``) is trained
    on, which is how the model learns to stop, while the newline before the next header is not.

    Some templates render a turn differently once more turns follow (Qwen3 drops earlier turns' reasoning, given
    as ``reasoning_content`` or inline in ``<think>``, and gives only the last turn an empty think block). Where a
    prefix so disagrees with the whole chat, the turn is found by the template's own markers, learnt from this
    chat: it starts after the next generation prompt (``<|im_start|>assistant\n``) and ends with the first
    end-of-turn token after its content (tool calls included), as the template's ``{% generation %}`` blocks
    would mark it; without markers, after its content (its answer, for inline reasoning) and the one token of
    ``end_tokens`` (the tokenizer's added tokens) that follows it. ``render_prefix(messages,
    add_generation_prompt)`` returns None when a template cannot render a prefix (e.g. an empty one).
    """
    spans: list[Span] = []
    cursor, markers = 0, None
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_prefix(messages[:index], True)
        start = _agreement(text, prompt)
        if prompt is not None and start < len(prompt):  # an earlier turn renders otherwise once this one follows
            markers = markers or _turn_markers(render_prefix, messages, index, prompt, end_tokens)
            found = text.find(markers[0], cursor) if markers[0] else -1
            start = found + len(markers[0]) if found >= 0 else start
        start = max(cursor, start)
        whole = render_prefix(messages[:index + 1], False)
        agreed = _agreement(text, whole)
        end = len(text[:agreed].rstrip())
        content_end = _content_end(text, message.get("content"), start)
        if whole is not None and agreed < len(whole.rstrip()):  # this turn renders otherwise once more follow
            markers = markers or _turn_markers(render_prefix, messages, index, prompt, end_tokens)
            header, closing = markers
            found = text.find(closing, max(start, content_end)) if closing else -1
            following = text.find(header, start) if header else -1
            if found >= 0 and (following < 0 or found < following):
                end = found + len(closing)
        if end < content_end:
            end = _after_end_token(text, content_end, end_tokens)
        spans.append((start, max(start, end)))
        cursor = max(start, end)
    return spans


#: an assistant turn's text that no template changes, for learning its markers (`_turn_markers`)
_PROBE = "posttune probe 7f3a"


def _turn_markers(render_prefix: Callable[[list[dict[str, Any]], bool], str | None], messages: list[dict[str, Any]],
                  index: int, prompted: str | None, end_tokens: Sequence[str]) -> tuple[str, str]:
    """(the generation prompt, the end-of-turn token): what this template writes before and after an assistant
    turn, from the conversation before turn ``index`` rendered without the prompt and with it (``prompted``, as
    `assistant_spans` rendered it), and with a probe turn after it; "" for what cannot be learnt (the turn is then
    found as the docstring above says)."""
    before = render_prefix(messages[:index], False)
    header = prompted[len(before):] if before is not None and prompted and prompted.startswith(before) else ""
    probe = render_prefix([*messages[:index], {"role": "assistant", "content": _PROBE}], False) or ""
    if _PROBE not in probe:
        return header, ""
    content_end = probe.index(_PROBE) + len(_PROBE)
    token_start = len(probe) - len(probe[content_end:].lstrip())
    return header, probe[token_start:_after_end_token(probe, content_end, end_tokens)]


def _agreement(text: str, prefix: str | None) -> int:
    """How many leading characters ``prefix`` shares with ``text``."""
    if prefix is None:
        return 0
    limit = min(len(text), len(prefix))
    if text[:limit] == prefix[:limit]:
        return limit
    return next(i for i in range(limit) if text[i] != prefix[i])


def _content_end(text: str, content: Any, start: int) -> int:
    """Where the turn's content ends in ``text``: the whole content, or (reasoning written inline, ``<think>...
    </think>answer``, which Qwen3's and DeepSeek-R1's templates drop from earlier turns) the answer after it."""
    if not isinstance(content, str):
        return start
    for needle in dict.fromkeys([content.strip(), content.rpartition("</think>")[2].strip()]):
        found = text.find(needle, start) if needle else -1
        if found >= 0:
            return found + len(needle)
    return start


def _after_end_token(text: str, position: int, end_tokens: Sequence[str]) -> int:
    rest = len(text) - len(text[position:].lstrip())
    for token in sorted(end_tokens, key=len, reverse=True):
        if token and text.startswith(token, rest):
            return rest + len(token)
    return position


def tokens_in_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[bool]:
    """True for each token whose characters overlap a span (the rule of transformers' assistant mask)."""
    return [any(token_start < end and token_end > start for start, end in spans) for token_start, token_end in offsets]


def _one_line(exc: BaseException, limit: int = 500) -> str:
    """The message on one line, cut at ``limit`` characters (a template may raise with any text)."""
    text = " ".join(str(exc)[:limit * 4].split())
    return text if len(text) <= limit else text[:limit] + "..."
