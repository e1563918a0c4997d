"""How many characters a chat template's operation will build, foreseen before it runs.

`posttune.template_limits` spends a render's character budget on what a template builds. For
the operations whose result can dwarf their inputs (repeating ``'A' * 10**9``, padding
``center(10**9)``, joining, formatting ``'{:>1000000000}'``, printing a list that holds one
list twice, thirty levels deep) the size is worked out here from the inputs, so the budget
refuses the operation before anything is allocated. Every other operation grows its inputs
by a small factor at most and is counted after it ran (`result_size`).

Sizes are upper bounds, cheap to compute: real templates build a few times the text of a
conversation, far below the budget, so a generous bound costs nothing. A list, tuple or dict
entry costs ``ITEM_CHARS`` characters, and filters that do Python work for every word
(``urlize``, ``title``, ``wordwrap``, ``striptags``) pay several characters for each one they
read: what one operation may cost stays within seconds, as the deadline is only checked
between operations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sized
from string import Formatter
from typing import Any

import jinja2
from jinja2.utils import Namespace

#: what one entry of a list, tuple or dict costs, in characters: its pointer and object, and the Python work
#: a filter does for it (a budget of 32 Mi characters holds a million entries)
ITEM_CHARS = 32
_TEXT = (str, bytes)
_SEQUENCE = (str, bytes, list, tuple)
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
# a % conversion: optional (key), flags, width, precision
_CONVERSION = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_NUMBER = re.compile(r"\d+")


def result_size(value: Any) -> int:
    """What a value just built costs: its characters, or ``ITEM_CHARS`` per entry of a container."""
    if isinstance(value, _TEXT):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return ITEM_CHARS * len(value)
    return 0


def text_size(value: Any, *, quoted: bool = False, separators: int = 2, indent: int = 0) -> int:
    """An upper bound on ``len(str(value))``; ``quoted``: of its repr or JSON, as inside a container.

    ``separators`` is what each entry adds (``", "``), ``indent`` the spaces per nesting level
    when entries go one a line (``tojson(indent=...)``, ``pprint``). Data is a tree and is
    measured in one pass; a structure that holds one container twice (``[x, x]`` nested thirty
    deep prints 2**30 entries) is measured container by container, each once.
    """
    if type(value) is str and not quoted:
        return len(value)
    if _entries(value) is None:
        return _scalar_size(value, quoted)
    size = _tree_size(value, separators) if indent <= 0 else _indented_tree_size(value, separators, indent)
    return size if size is not None else _shared_size(value, quoted, separators, indent)


def _tree_size(value: Any, separators: int) -> int | None:
    """The size of a container when no container occurs twice in it (None when one does)."""
    seen: set[int] = set()  # ids: everything measured lives in ``value`` until we return
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:  # most of what data holds: inlined
            total += 2 * len(item) + 16 if item.isascii() and item.isprintable() else 12 * len(item) + 16
            continue
        entries = item if kind is dict or kind is list else _entries(item)
        if entries is None:
            total += _scalar_size(item, True)
            continue
        if id(entries) in seen:
            return None
        seen.add(id(entries))
        total += 32 + len(entries) * separators
        stack.extend(entries)  # a dict's keys
        if type(entries) is dict:
            stack.extend(entries.values())
    return total


def _indented_tree_size(value: Any, separators: int, indent: int) -> int | None:
    """`_tree_size` when each entry goes on its own line, indented by its depth."""
    seen: set[int] = set()
    total, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        entries = _entries(item)
        if entries is None:
            total += _scalar_size(item, True)
            continue
        if id(entries) in seen:
            return None
        seen.add(id(entries))
        depth += 1
        total += 32 + len(entries) * (separators + indent * depth + 1)
        if type(entries) is dict:
            for key, entry in entries.items():
                stack.append((key, depth))
                stack.append((entry, depth))
        else:
            for entry in entries:
                stack.append((entry, depth))
    return total


def _shared_size(value: Any, quoted: bool, separators: int, indent: int) -> int:
    known: dict[tuple[int, int], int] = {}  # by id: everything measured lives in ``value`` until we return
    open_ids: set[int] = set()

    def size(item: Any, depth: int) -> int:
        entries = _entries(item)
        if entries is None:
            return _scalar_size(item, quoted or depth > 0)
        key = (id(entries), depth if indent > 0 else 0)
        if key not in known:
            if id(entries) in open_ids:  # a namespace that holds itself prints as {...}
                return 8
            open_ids.add(id(entries))
            parts = [*entries, *entries.values()] if isinstance(entries, dict) else entries
            per_entry = separators + (indent * (depth + 1) + 1 if indent > 0 else 0)
            known[key] = 32 + len(entries) * per_entry + sum(size(part, depth + 1) for part in parts)
            open_ids.discard(id(entries))
        return known[key]

    return size(value, 0)


def _entries(item: Any) -> Any:
    """What a container prints (a dict view or namespace: its dict), or None for anything else."""
    if isinstance(item, (list, tuple, dict, set, frozenset)):
        return item
    if isinstance(item, _DICT_VIEWS):
        return item.mapping
    if isinstance(item, Namespace):
        return item._Namespace__attrs  # type: ignore[attr-defined]  # what its repr prints
    return None


def _scalar_size(item: Any, quoted: bool) -> int:
    if isinstance(item, str):
        if not quoted:
            return len(item)
        # repr and JSON write a quote or backslash as two characters, '\\x00' as four, an astral one as 12
        return 2 * len(item) + 16 if item.isascii() and item.isprintable() else 12 * len(item) + 16
    if isinstance(item, bytes):
        return 4 * len(item) + 3
    if isinstance(item, int) and not isinstance(item, bool):
        return item.bit_length() // 3 + 2
    if item is None or isinstance(item, (bool, float)):
        return 32
    # an undefined value prints as nothing; a macro, a function or a range as a short repr
    return 0 if isinstance(item, jinja2.Undefined) and not quoted else 64


# -- operators ------------------------------------------------------------------------------------

def binop_size(operator: str, left: Any, right: Any) -> int:
    """Characters ``left <operator> right`` builds (0 when it builds no text or container)."""
    if operator == "+":
        if isinstance(left, _SEQUENCE) and isinstance(right, _SEQUENCE):
            return _weight(left) * (len(left) + len(right))
    elif operator == "*":
        sequence, times = (left, right) if isinstance(left, _SEQUENCE) else (right, left)
        if isinstance(sequence, _SEQUENCE) and isinstance(times, int):
            return _weight(sequence) * len(sequence) * max(times, 0)
    elif operator == "%" and isinstance(left, _TEXT):
        return percent_size(left, right)
    return 0


def number_bits(operator: str, left: Any, right: Any) -> int:
    """Bits of the integer ``left * right`` or ``left ** right`` will be, at most (0 for other operands)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if operator == "*":
        return left.bit_length() + right.bit_length()
    if operator == "**" and right > 0 and abs(left) > 1:
        return right * left.bit_length()
    return 0


def _weight(sequence: Any) -> int:
    return 1 if isinstance(sequence, _TEXT) else ITEM_CHARS


def percent_size(fmt: str | bytes, args: Any) -> int:
    """``fmt % args``: the format, plus each conversion at its widest argument and widest width."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    values = list(args) if isinstance(args, tuple) else [args]  # a mapping's repr bounds any value it gives
    widths = [0]
    for width, precision in _CONVERSION.findall(text):
        for number in (width, precision):
            if number == "*":
                widths.extend(value for value in values if isinstance(value, int))
            elif number:
                widths.append(int(number))
    longest = max((text_size(value, quoted=True) for value in values), default=0)
    return len(text) + text.count("%") * (longest + max(widths))


def format_size(fmt: str, values: list[Any]) -> int:
    """``fmt.format(*values)``: the format, plus each field at the widest value and widest width."""
    fields, widest, nested = 0, 0, False
    for _literal, field, spec, _conversion in Formatter().parse(fmt):
        if field is None:
            continue
        fields += 1
        if spec:
            nested = nested or "{" in spec
            widest = max(widest, *(int(number) for number in _NUMBER.findall(spec)), 0)
    if nested:  # '{:{w}}': a width taken from the arguments
        widest = max(widest, *(value for value in values if isinstance(value, int)), 0)
    longest = max((text_size(value, quoted=True) for value in values), default=0)
    return len(fmt) + fields * (longest + widest)


# -- methods of str and bytes, and int.to_bytes ---------------------------------------------------

def method_size(owner: Any, name: str, args: tuple, kwargs: dict[str, Any]) -> int:
    """Characters ``owner.name(*args, **kwargs)`` builds, where that can dwarf ``owner`` (else 0).

    ``join`` is given its items as a list (the caller lists an iterator first, so the items are
    measured and then joined, not consumed twice).
    """
    if isinstance(owner, int) and name == "to_bytes":
        return max(_int(_arg(args, kwargs, 0, "length", 1)), 0)
    if not isinstance(owner, _TEXT):
        return 0
    length = len(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(length, _int(_arg(args, kwargs, 0, "width", 0)))
    if name == "expandtabs":
        tab = "\t" if isinstance(owner, str) else b"\t"
        return length + owner.count(tab) * max(_int(_arg(args, kwargs, 0, "tabsize", 8)), 0)
    if name == "replace":
        return replace_size(owner, args[0], args[1], _arg(args, kwargs, 2, "count", -1))
    if name == "join" and isinstance(args[0], list):
        items = args[0]
        return length * max(len(items) - 1, 0) + sum(len(item) for item in items if isinstance(item, _TEXT))
    if name == "translate" and isinstance(args[0], Mapping):
        longest = max((len(value) for value in args[0].values() if isinstance(value, _TEXT)), default=1)
        return length * max(longest, 1)
    if name == "encode":  # 'unicode_escape' writes up to ten bytes a character
        return 10 * length
    if name in ("split", "rsplit"):
        sep = _arg(args, kwargs, 0, "sep", None)
        parts = owner.count(sep) + 1 if sep else length // 2 + 1
        return ITEM_CHARS * parts + length
    if name == "splitlines":
        return ITEM_CHARS * (length + 1) + length
    return 0


def replace_size(text: str | bytes, old: Any, new: Any, count: Any) -> int:
    hits = text.count(old) if len(old) else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _arg(args: tuple, kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _int(value: Any) -> int:
    """An int argument as given; anything else counts 0 (the operation itself then refuses it)."""
    return value if isinstance(value, int) else 0


# -- filters: each takes the filter's own parameters, the filtered value first --------------------

def _center(value: Any, width: Any = 80) -> int:
    return max(text_size(value), _int(width))


def _indent(s: Any, width: Any = 4, first: Any = False, blank: Any = False) -> int:
    pad = len(width) if isinstance(width, str) else _int(width)
    lines = s.count("\n") + 1 if isinstance(s, str) else text_size(s) + 1
    return text_size(s) + lines * max(pad, 0)


def _wordwrap(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
              break_on_hyphens: Any = True) -> int:
    """A break at most every character; and textwrap works in Python, word by word (4 a character)."""
    return text_size(s) * (4 + len(str(wrapstring if wrapstring is not None else "\n")))


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        return replace_size(s, old, new, count)
    return text_size(s) * (1 + len(str(new)))


def _join(value: Any, d: Any = "", attribute: Any = None) -> int:
    return sum(text_size(entry) for entry in value) + len(str(d)) * max(len(value) - 1, 0)


def _format(value: Any, *args: Any, **kwargs: Any) -> int:
    return percent_size(str(value), kwargs or args)


def _batch(value: Any, linecount: Any, fill_with: Any = None) -> int:
    fill = _int(linecount) if fill_with is not None else 0
    return ITEM_CHARS * ((len(value) if isinstance(value, Sized) else 0) + max(fill, 0))


def _slice(value: Any, slices: Any, fill_with: Any = None) -> int:
    return ITEM_CHARS * ((len(value) if isinstance(value, Sized) else 0) + max(_int(slices), 0))


def _sum(iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    if not isinstance(start, (list, tuple)):
        return 0  # numbers
    measured: dict[int, int] = {}  # by id: ``[[1] * 1000] * 3000`` holds one list 3000 times
    running, total = len(start), 0  # sum() of lists builds every partial list
    for entry in iterable:
        if id(entry) not in measured:  # an attribute of an entry is no longer than the entry prints
            measured[id(entry)] = len(entry) if attribute is None and isinstance(entry, Sized) else text_size(entry)
        running += measured[id(entry)]
        total += running
    return ITEM_CHARS * total


def _tojson(value: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None,
            sort_keys: Any = False) -> int:
    pad = len(indent) if isinstance(indent, str) else _int(indent)
    item, key = separators if separators is not None else (", ", ": ")
    return text_size(value, quoted=True, separators=len(item) + len(key), indent=max(pad, 0))


def _pprint(value: Any) -> int:
    return text_size(value, quoted=True, indent=1)


def _list(value: Any) -> int:
    return ITEM_CHARS * len(value) if isinstance(value, Sized) else 0


def _per_word(factor: int) -> Any:
    """A filter doing Python work for every word: ``factor`` characters for each character it reads."""
    def size(value: Any, *args: Any, **kwargs: Any) -> int:
        return factor * text_size(value)

    return size


#: filters whose result can dwarf their input, or that work long on it, by name: their size before they run
FILTER_SIZES = {"center": _center, "indent": _indent, "wordwrap": _wordwrap, "replace": _replace, "join": _join,
                "format": _format, "batch": _batch, "slice": _slice, "sum": _sum, "tojson": _tojson,
                "pprint": _pprint, "list": _list, "urlize": _per_word(16), "title": _per_word(4),
                "striptags": _per_word(4)}
#: filters that make text of any value: a list given to them is measured as the text it prints
STRINGIFYING = frozenset({"capitalize", "e", "escape", "forceescape", "lower", "safe", "string", "trim", "truncate",
                          "upper", "urlencode", "wordcount", "xmlattr"})
#: filters whose value is listed first when it is an iterator, so it is measured, then used
LISTED = frozenset({"join", "sum"})
