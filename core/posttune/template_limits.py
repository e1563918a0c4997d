"""Limits on rendering a chat template: a deadline and a budget of characters, enforced in-process.

A chat template is Jinja code from the hub, run for every row of a dataset. jinja2's sandbox
keeps it from Python's internals, not from running for hours (nested ``range`` loops, a macro
that calls itself twice) or from building gigabytes (``'A' * 10**9``, a string doubled in a
loop, ``center(10**9)``). Here every render gets

- a deadline, ``POSTTUNE_CHAT_TEMPLATE_TIMEOUT`` seconds (default 10), checked at every
  iteration of every ``{% for %}`` loop and at every call and filter: the only ways a template
  repeats work;
- a budget of characters, ``POSTTUNE_CHAT_TEMPLATE_MAX_CHARS`` (default 32 Mi), spent by what
  the template builds and writes: the results of ``+ * % **``, ``~``, calls, filters and
  slices, what it outputs, and a loop body's own text and literals on each iteration. Where a
  result can dwarf its inputs its size is foreseen (`posttune.template_sizes`) and spent before
  it is built, so nothing huge is ever allocated.

Going past either raises `TemplateLimitError`, as does going past Python's recursion limit (a
macro that never stops calling itself) or running out of memory. The environment variables are
read when a tokenizer is built (`read_limits`). Real templates render a conversation in well
under a millisecond and build a few times its text, far from both limits. The checks run
in-process (no subprocess, no signal), cheap enough for every row: on a Qwen2.5 template they
add about a quarter to a bare render, 5-7% to a row's ``tokenize_messages``.

How: the template's syntax tree is rewritten before it is compiled, so every loop iterates
through `LoopItems`, every ``~`` goes through a checked join and every slice is paid for (as
filters, which compile to plain calls, under names no template can write); `LimitedSandbox`
intercepts the operators, calls, ``str.format`` and output (jinja2's own sandbox hooks) and
wraps every filter.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sized
from contextvars import ContextVar
from dataclasses import dataclass
from functools import wraps
from time import monotonic
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.runtime import LoopContext, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum, pass_context
from jinja2.visitor import NodeTransformer

from posttune import template_sizes as sizes
from posttune.errors import PosttuneError

TIMEOUT_ENV = "POSTTUNE_CHAT_TEMPLATE_TIMEOUT"
MAX_CHARS_ENV = "POSTTUNE_CHAT_TEMPLATE_MAX_CHARS"
DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_CHARS = 32 * 2**20
#: the largest integer a template may compute, in bits; a bigger one is refused, not computed (``9**9**9``)
MAX_NUMBER_BITS = 2**16
# what a size estimate may raise on arguments the operation itself refuses (it then raises its own error)
_BAD_ARGUMENTS = (TypeError, ValueError, LookupError, AttributeError, OverflowError)


class TemplateLimitError(PosttuneError):
    """A chat template went past a rendering limit.

    The template is at fault, not the row it rendered: callers that skip bad rows let this through, but for a row
    whose own text is half the character budget (`posttune.data.samples`).
    """


@dataclass(frozen=True)
class RenderLimits:
    """How long one render may run and how many characters it may build."""

    seconds: float = DEFAULT_TIMEOUT
    max_chars: int = DEFAULT_MAX_CHARS


def read_limits() -> RenderLimits:
    """The limits the environment sets (``POSTTUNE_CHAT_TEMPLATE_TIMEOUT``, ``..._MAX_CHARS``), else the defaults.

    A tokenizer reads them once, when it is built: reading the environment at every render
    would cost more than the checks themselves.
    """
    return RenderLimits(_setting(TIMEOUT_ENV, DEFAULT_TIMEOUT, float, "a number of seconds > 0"),
                        _setting(MAX_CHARS_ENV, DEFAULT_MAX_CHARS, int, "a whole number of characters > 0"))


def _setting(name: str, default: Any, kind: Callable[[str], Any], expected: str) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or not math.isfinite(value):
        raise PosttuneError(f"{name}={raw!r}: expected {expected}")
    return value


@dataclass
class Budget:
    """One render's deadline and the characters it may still build."""

    limits: RenderLimits
    deadline: float
    chars_left: int
    loop_chars: int = 0  # text one iteration of a recursive loop may write (its body's)

    def tick(self) -> None:
        if monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering ran past {self.limits.seconds:g} s (the limit; {TIMEOUT_ENV} "
                                     "sets it)")

    def spend(self, chars: int) -> None:
        self.chars_left -= chars
        if self.chars_left < 0:
            raise TemplateLimitError(f"rendering built more than {self.limits.max_chars:,} characters (the limit; "
                                     f"{MAX_CHARS_ENV} sets it)")


def new_budget(limits: RenderLimits, loop_chars: int = 0) -> Budget:
    """A budget with ``limits``, its deadline counted from now."""
    return Budget(limits, monotonic() + limits.seconds, limits.max_chars, loop_chars)


_budget: ContextVar[Budget | None] = ContextVar("posttune_template_budget", default=None)


def current() -> Budget:
    """The running render's budget. Outside one (jinja2 folding constants while it compiles) a fresh
    default one each time: an operation on constants is still refused past the default budget."""
    budget = _budget.get()
    return budget if budget is not None else new_budget(RenderLimits())


class LoopItems:
    """What a ``{% for %}`` iterates: its items, checking the deadline and spending the loop body's text
    on every iteration. Sized when the items are, so ``loop.length`` works as before."""

    __slots__ = ("chars", "items")

    def __init__(self, items: Any, chars: int):
        self.items, self.chars = items, chars

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        budget, chars = current(), self.chars
        for item in self.items:
            if monotonic() > budget.deadline:
                budget.tick()
            if chars:
                budget.spend(chars)
            yield item


#: the helpers a rewritten template calls, registered as filters under names no template can write
LOOP_FILTER, CONCAT_FILTER, SLICE_FILTER = "(posttune: bounded loop)", "(posttune: checked ~)", "(posttune: slice)"


@pass_context  # never run while compiling, outside a render's budget
def _loop_items(context: Any, items: Any, chars: int) -> LoopItems:
    return LoopItems(items, chars)


@pass_context
def _concat(context: Any, *values: Any) -> str:
    """``a ~ b``: measured, then joined as jinja2 joins (escaping only under autoescape)."""
    current().spend(sum(len(value) if type(value) is str else sizes.text_size(value) for value in values))
    return markup_join(values) if context.eval_ctx.autoescape else str_join(values)


@pass_context
def _sliced(context: Any, value: Any) -> Any:
    """``s[a:b]`` (compiled as a plain subscript, not through the sandbox): paid for once taken."""
    (_budget.get() or current()).spend(sizes.result_size(value))
    return value


class _Bounder(NodeTransformer):
    """Rewrites a parsed template: loops iterate through `LoopItems`, ``~`` through `_concat`."""

    def __init__(self) -> None:
        self.recursive_loop_chars = 0

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        chars = _literal_chars(node.body)
        if node.recursive:
            self.recursive_loop_chars = max(self.recursive_loop_chars, chars)
        node.iter = _helper(LOOP_FILTER, [node.iter, nodes.Const(chars)], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Expr:
        self.generic_visit(node)
        if all(isinstance(operand, nodes.Const) for operand in node.nodes):
            return node  # folded when compiled: no bigger than the template's own text
        return _helper(CONCAT_FILTER, node.nodes, node.lineno)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Expr:
        self.generic_visit(node)
        return _helper(SLICE_FILTER, [node], node.lineno) if isinstance(node.arg, nodes.Slice) else node


def _helper(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Filter:
    """``args[0] | name(*args[1:])``: a filter compiles to a plain call (a call would go through the sandbox)."""
    return nodes.Filter(args[0], name, list(args[1:]), [], None, None, lineno=lineno)


def _literal_chars(body: Iterable[nodes.Node]) -> int:
    """Text one pass through ``body`` writes as such (template text, constants), at most.

    Inner loops spend their own per iteration; macros and call blocks are spent when called.
    """
    total, stack = 0, list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, nodes.TemplateData):
            total += len(node.data)
        elif isinstance(node, nodes.Const):
            total += len(node.value) if isinstance(node.value, (str, bytes)) else 0
        elif isinstance(node, (nodes.List, nodes.Tuple, nodes.Dict)):  # a new container each time
            total += sizes.ITEM_CHARS * (len(node.items) + 1)
            stack.extend(node.iter_child_nodes())
        elif isinstance(node, nodes.For):
            stack.extend(node.else_)
        elif not isinstance(node, (nodes.Macro, nodes.CallBlock)):
            stack.extend(node.iter_child_nodes())
    return total


def _spend_output(value: Any) -> Any:
    """The environment's ``finalize``: every ``{{ value }}`` is paid for before it is printed."""
    budget = _budget.get() or current()  # the hot paths look the budget up inline
    budget.chars_left -= len(value) if type(value) is str else sizes.text_size(value)
    if budget.chars_left < 0:
        budget.spend(0)
    return value


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
    current().spend(n * (16 * max + 64) if isinstance(n, int) and isinstance(max, int) and n > 0 else 0)
    return generate_lorem_ipsum(n, html, min, max)


def _estimate(estimate: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    try:
        return estimate(*args, **kwargs)
    except _BAD_ARGUMENTS:
        return 0


def _listed(value: Any) -> Any:
    """An iterator as a list (measured, then used); anything else as it is."""
    return list(value) if isinstance(value, Iterable) and not isinstance(value, Sized) else value


def _limit_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with the deadline checked and what it builds paid for.

    The wrapper takes the context, so jinja2 never runs it on constants while compiling (outside
    any render's budget), and hands the filter what it asked for (context, eval context or environment).
    """
    passed = getattr(getattr(function, "jinja_pass_arg", None), "name", None)
    estimate = sizes.FILTER_SIZES.get(name)
    stringifies, listed = name in sizes.STRINGIFYING, name in sizes.LISTED
    checks_value = estimate is not None or stringifies

    @pass_context
    @wraps(function)
    def limited_filter(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget.get() or current()
        if monotonic() > budget.deadline:
            budget.tick()
        if checks_value and args:
            if listed:
                args = (_listed(args[0]), *args[1:])
            if estimate is not None:
                budget.spend(_estimate(estimate, *args, **kwargs))
            elif not isinstance(args[0], str):
                budget.spend(sizes.text_size(args[0]))
        if passed is not None:
            first = context.eval_ctx if passed == "eval_context" else context.environment
            args = (context if passed == "context" else first, *args)
        result = function(*args, **kwargs)
        budget.spend(sizes.result_size(result))
        return result

    return limited_filter


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, its templates rendering under a deadline and a character budget.

    Compile templates with `compile_limited` (which rewrites their loops); ``extra_filters`` and
    ``extra_globals`` join jinja2's own, and every filter is wrapped with the checks.
    """

    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, *, extra_filters: dict[str, Any] | None = None, extra_globals: dict[str, Any] | None = None,
                 extensions: Iterable[Any] = (), **options: Any):
        super().__init__(extensions=extensions, finalize=_spend_output, **options)
        self.filters.update(extra_filters or {})
        self.filters = {name: _limit_filter(name, function) for name, function in self.filters.items()}
        self.filters.update({LOOP_FILTER: _loop_items, CONCAT_FILTER: _concat, SLICE_FILTER: _sliced})
        self.globals.update(extra_globals or {})
        self.globals["lipsum"] = _lipsum

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # most of a template's operators
            budget = _budget.get() or current()
            budget.chars_left -= len(left) + len(right)
            if budget.chars_left < 0:
                budget.spend(0)
            return left + right
        if sizes.number_bits(operator, left, right) > MAX_NUMBER_BITS:
            raise TemplateLimitError(f"rendering computed a number of more than {MAX_NUMBER_BITS:,} bits")
        current().spend(_estimate(sizes.binop_size, operator, left, right))
        return self.binop_table[operator](left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget.get() or current()
        if monotonic() > budget.deadline:
            budget.tick()
        if isinstance(obj, LoopContext):  # loop(children) in a recursive loop: the next level iterates, checked
            args = (LoopItems(args[0], budget.loop_chars), *args[1:]) if args else args
        else:
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, (str, bytes, int)):
                name = getattr(obj, "__name__", "")
                if name == "join" and args:
                    args = (_listed(args[0]), *args[1:])
                budget.spend(_estimate(sizes.method_size, owner, name, args, kwargs))
        result = super().call(context, obj, *args, **kwargs)
        budget.spend(sizes.result_size(result))
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def limited_format(*args: Any, **kwargs: Any) -> str:
            values = list(args[:1]) if is_map else [*args, *kwargs.values()]
            current().spend(_estimate(sizes.format_size, fmt, values))
            return formatter(*args, **kwargs)

        return limited_format


@dataclass(frozen=True)
class LimitedTemplate:
    """A compiled template that renders under a fresh budget each time."""

    template: jinja2.Template
    recursive_loop_chars: int

    def render(self, variables: dict[str, Any], limits: RenderLimits) -> str:
        """The rendered text; past ``limits``, a `TemplateLimitError`."""
        token = _budget.set(new_budget(limits, self.recursive_loop_chars))
        try:
            return self.template.render(variables)
        except RecursionError:
            raise TemplateLimitError("rendering nested deeper than Python's recursion limit (a macro or loop that "
                                     "calls itself without end?)") from None
        except MemoryError:
            raise TemplateLimitError("rendering ran out of memory") from None
        finally:
            _budget.reset(token)


def compile_limited(environment: LimitedSandbox, source: str) -> LimitedTemplate:
    """Parse, rewrite and compile ``source`` (jinja2's public parse/compile steps, the tree rewritten between)."""
    tree = environment.parse(source)
    bounder = _Bounder()
    bounder.visit(tree)
    tree.set_environment(environment)
    code = environment.compile(tree)
    template = environment.template_class.from_code(environment, code, environment.make_globals(None), None)
    return LimitedTemplate(template, bounder.recursive_loop_chars)
