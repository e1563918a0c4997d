"""What a converter may answer for one tensor, and the bookkeeping that streams many-to-one maps.

``CheckpointConverter.to_native`` / ``from_native`` get one tensor and answer with:

- ``None``: the other side does not keep it (cached rotary frequencies);
- ``(key, tensor)``: one tensor under its other name (most families: a rename);
- an iterable of such pairs: one tensor becomes several (a fused ``qkv_proj`` split into q, k
  and v; a stacked expert tensor into one per expert); a generator makes each only when taken;
- ``(Join(key, parts, join), tensor)``: the tensor is one of ``parts`` (keys on its own side),
  which together make ``key``; it is held until the last part arrives, then ``join`` gets the
  parts in that order (``torch.cat`` to fuse q/k/v, ``torch.stack`` to stack experts).

Load and save both go through ``Joiner``: nothing is held but the parts of unfinished joins, and
a join that never completes is one line naming its missing parts. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttune.errors import PosttuneError

SHOWN = 5  # names listed in one error line before "and N more"


@dataclass(frozen=True)
class Join:
    """A converter's key for a tensor that is one part of ``key`` (many-to-one)."""

    key: str  # the tensor the parts make, on the other side
    parts: tuple[str, ...]  # every part's key on this side, in the order ``join`` takes them
    join: Callable[[list[Any]], Any]  # the parts' tensors -> the tensor ``key``


def pairs(result: Any) -> Iterable[tuple[str | Join, Any]]:
    """A converter's answer for one tensor as (key, tensor) pairs: none, one, or several."""
    if result is None:
        return ()
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (str, Join)):
        return (result,)
    return result


def first_key(result: Any) -> str | None:
    """The first key of a converter's answer, for messages (a join's whole tensor)."""
    for key, _ in pairs(result):
        return key.key if isinstance(key, Join) else key
    return None


class Joiner:
    """Converts tensors one at a time, holding the parts of each unfinished join; one per pass."""

    def __init__(self, convert: Callable[[str, Any, Mapping[str, Any]], Any], config: Mapping[str, Any]):
        self.convert, self.config = convert, config
        self.held: dict[str, tuple[Join, dict[str, Any]]] = {}

    def __call__(self, key: str, tensor: Any) -> Iterator[tuple[str, str, Any]]:
        """(source key, converted key, tensor) for every tensor complete once ``key`` is converted."""
        for item in pairs(self.convert(key, tensor, self.config)):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (str, Join))):
                raise PosttuneError(f"converter: '{key}' became {type(item).__name__}, not a (key, tensor) pair")
            out, value = item
            if not isinstance(out, Join):
                yield key, out, value
                continue
            if key not in out.parts:
                raise PosttuneError(f"converter: '{key}' is not one of the parts of '{out.key}' it joins "
                                    f"({names(list(out.parts))})")
            join, parts = self.held.setdefault(out.key, (out, {}))
            parts[key] = value
            if len(parts) == len(join.parts):
                del self.held[out.key]
                try:
                    value = join.join([parts.pop(part) for part in join.parts])
                except (RuntimeError, ValueError) as exc:  # parts of mismatched shapes
                    raise PosttuneError(f"cannot join '{out.key}' from {names(join.parts)}: {exc}") from None
                yield join.parts[0], out.key, value

    def finish(self, where: str) -> None:
        """Every join completed; else one line naming the first unfinished one's missing parts."""
        if self.held:
            key, (join, parts) = next(iter(self.held.items()))
            others = f" ({len(self.held) - 1} more tensors are incomplete)" if len(self.held) > 1 else ""
            missing = [part for part in join.parts if part not in parts]
            raise PosttuneError(f"{where}: tensor '{key}' is joined from {len(join.parts)} parts; missing "
                                f"{names(missing)}{others}")


def names(items: Sequence[str]) -> str:
    shown = ", ".join(f"'{item}'" for item in items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
